"""Fault injection beyond tests/test_durability.py: LMDB map growth inside eviction
write-backs, injected EIO on commit and on read, a corrupt B-tree page, store files of the
wrong kind, and a store's saved policy file going bad.  Each fault must surface as a
typed error naming the file, and change nothing; the store must work once it clears.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm
import hiermem.tiers.disk as disk_mod
from reference import FlatStore

DEV, HOST = 4, 16
TABLES = [hm.TableSpec("b", 60, 4), hm.TableSpec("h", None, 3)]
HASHED = torch.tensor([3, 2**33, 2**62 + 5, 2**63 - 1, 17, 123456], dtype=torch.int64)


def make(path, **kw):
    cfg = hm.StoreConfig(path=path, device_rows=kw.pop("device_rows", DEV), host_rows=kw.pop("host_rows", HOST),
                         optimizer=kw.pop("optimizer", hm.Adagrad(lr=0.1)), seed=2, **kw)
    return hm.HierarchicalStore(TABLES, cfg)


def train(s, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        name, pool = ("b", torch.arange(60)) if i % 3 else ("h", HASHED)
        ids = pool[torch.randint(0, pool.numel(), (10,), generator=g)]
        emb = s.lookup(name, ids)
        s.update(name, ids, 0.5 * emb + torch.randn(emb.shape, generator=g))


def snapshot(s):
    return {"b": torch.cat([s.lookup("b", torch.arange(i, i + 20)) for i in range(0, 60, 20)]),
            "h": s.lookup("h", HASHED)}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def pair(tmp_path):
    """Two stores with the same history and dirty rows in both tiers: ``s`` gets the fault,
    ``twin`` says what ``s`` must still hold."""
    stores = [make(tmp_path / n, write_combine=0) for n in ("s", "twin")]  # each write-back commits in its op
    for st in stores:
        train(st, 30, seed=1)
    s, twin = stores
    assert s.stats()["_store"]["device_dirty"] and s.stats()["_store"]["host_dirty"]
    yield s, twin
    for st in stores:
        if not st.closed:
            st.close()


# -- duplicate ids in one disk read (a bug this suite found) ----------------------------------
def test_duplicate_ids_read_the_same_record_from_disk(tmp_path):
    s = make(tmp_path / "s", device_rows=2, host_rows=2)
    try:
        s.write("b", torch.tensor([0, 7]), torch.ones(2, 4))
        s.write("h", torch.tensor([2**63 - 1, 256]), torch.full((2, 3), 2.0))
        s.flush()
        s.lookup("b", torch.arange(10, 14))  # evict them all: they live in LMDB only
        disk = int(hm.Tier.DISK)
        assert s.where("b", torch.tensor([0, 7, 0, 3, 0])).tolist() == [disk, disk, disk, int(hm.Tier.INIT), disk]
        assert s.where("h", torch.tensor([2**63 - 1, 256, 2**63 - 1])).tolist() == [disk] * 3
        found, rec = s._disk.read(0, np.array([7, 0, 7, 7, 5]), s.widths[0])
        assert found.tolist() == [True, True, True, True, False]
        assert (rec[:4, :4] == 1).all() and (rec[4] == 0).all()
    finally:
        s.close()


# -- LMDB map full, inside eviction write-backs ------------------------------------------------
@pytest.mark.parametrize("combine", [0, 512], ids=["each-write-back", "combined"])
def test_map_full_during_write_backs_grows_and_training_stays_exact(tmp_path, combine):
    """Map of 1 MiB, rows of 64 floats + Adagrad state: the map fills inside evicting
    lookups and updates (not only in flush); it grows and every row equals the reference.
    Write-backs committed each, or combined (committed every ~5 updates)."""
    spec = [hm.TableSpec("t", None, 64)]
    opt = hm.Adagrad(lr=0.05)
    s = hm.HierarchicalStore(spec, hm.StoreConfig(path=tmp_path / "s", device_rows=32, host_rows=96,
                                                  optimizer=opt, map_size=1 << 20, write_combine=combine))
    ref = FlatStore(spec, opt)
    g = torch.Generator().manual_seed(0)
    grown_in = set()
    try:
        for step in range(40):
            ids = torch.randint(0, 3000, (100,), generator=g) * 7919
            before = s.stats()["_store"]["lmdb_map_size"]
            grads = torch.randn(100, 64, generator=g)
            s.update("t", ids, grads)
            ref.update("t", ids, grads)
            if s.stats()["_store"]["lmdb_map_size"] > before:
                grown_in.add("update")
        assert "update" in grown_in and s.stats()["_store"]["flushes"] == 0
        assert s.stats()["_store"]["lmdb_map_size"] >= 4 << 20
        touched = torch.tensor(sorted(ref.rows["t"]), dtype=torch.int64)
        for i in range(0, touched.numel(), 120):
            assert torch.allclose(s.lookup("t", touched[i:i + 120]), ref.lookup("t", touched[i:i + 120]), atol=1e-6)
        s.close()
        s = hm.HierarchicalStore.open(tmp_path / "s")
        for i in range(0, touched.numel(), 120):
            assert torch.allclose(s.lookup("t", touched[i:i + 120]), ref.lookup("t", touched[i:i + 120]), atol=1e-6)
    finally:
        s.close()


# -- injected I/O errors -----------------------------------------------------------------------------
class _Txn:
    def __init__(self, txn, fail_commit, read_error):
        self.txn, self.fail_commit, self.read_error = txn, fail_commit, read_error

    def __enter__(self):
        self.txn.__enter__()
        return self

    def __exit__(self, *exc):
        if self.fail_commit and exc[0] is None:
            self.txn.abort()
            raise lmdb.Error(self.fail_commit)
        return self.txn.__exit__(*exc)

    def cursor(self, *a, **kw):
        cur = self.txn.cursor(*a, **kw)
        if self.read_error:
            class Failing:
                def getmulti(self, *a, **kw):
                    raise lmdb.Error("mdb_cursor_get: Input/output error")
            return Failing()
        return cur

    def __getattr__(self, name):
        return getattr(self.txn, name)


class _FaultyEnv:
    """An lmdb.Environment whose write transactions fail to commit with ``fail_commit``
    and/or whose reads of rows fail with EIO."""

    def __init__(self, env, fail_commit=None, read_error=False):
        self._env, self.fail_commit, self.read_error = env, fail_commit, read_error
        self.faults = 0

    def begin(self, *a, **kw):
        txn = self._env.begin(*a, **kw)
        write = kw.get("write", False)
        if (write and self.fail_commit) or (not write and self.read_error):
            self.faults += 1
        return _Txn(txn, self.fail_commit if write else None, self.read_error and not write)

    def __getattr__(self, name):
        return getattr(self._env, name)


FRESH = torch.arange(20) * 1_000_003 + 11  # 20 rows never seen: evict every resident row
OPS = {
    "flush": lambda s: s.flush(),
    "lookup": lambda s: s.lookup("h", FRESH),
    "update": lambda s: s.update("h", FRESH, torch.ones(20, 3)),
    "write": lambda s: s.write("b", torch.arange(40, 60), torch.zeros(20, 4)),
    "lookup_pooled": lambda s: s.lookup_pooled("h", FRESH, torch.tensor([0, 5])),
    "clear": lambda s: s.clear(),
}


@pytest.mark.parametrize("disk_full", [False, True], ids=["eio", "eio-disk-full"])
@pytest.mark.parametrize("op", ["flush", "lookup", "update", "write", "clear"])
def test_eio_on_commit_is_typed_and_changes_nothing(pair, monkeypatch, op, disk_full):
    """LMDB reports a failed write as EIO: with room on the disk that is an LMDB write
    failure (HierMemError), on a full disk it is DiskFullError; either way nothing changed."""
    s, twin = pair
    if disk_full:
        st = namedtuple("st", "f_bavail f_frsize")(0, 4096)
        monkeypatch.setattr(disk_mod.os, "statvfs", lambda p: st)
    real = s._disk.env
    s._disk.env = fake = _FaultyEnv(real, fail_commit="mdb_txn_commit: Input/output error")
    try:
        with pytest.raises(hm.HierMemError) as ei:
            OPS[op](s)
    finally:
        s._disk.env = real
        monkeypatch.undo()
    assert fake.faults >= 1
    assert isinstance(ei.value, hm.DiskFullError) == disk_full, ei.value
    assert str(s.path) in str(ei.value)
    assert same(snapshot(s), snapshot(twin))
    s.flush()  # the fault cleared: everything is written, and survives a reopen
    want = snapshot(twin)
    s.close()
    s2 = hm.HierarchicalStore.open(s.path)
    try:
        assert same(snapshot(s2), want)
    finally:
        s2.close()


@pytest.mark.parametrize("op", ["lookup", "update", "lookup_pooled", "where"])
def test_read_error_is_typed_names_the_file_and_changes_nothing(pair, op):
    s, twin = pair
    real = s._disk.env
    s._disk.env = fake = _FaultyEnv(real, read_error=True)
    try:  # an I/O error is not corruption: StoreIOError with its errno (after retries)
        with pytest.raises(hm.StoreIOError) as ei:
            if op == "where":
                s.where("h", FRESH)
            else:
                OPS[op](s)
    finally:
        s._disk.env = real
    assert fake.faults >= 1
    assert "Input/output error" in str(ei.value) and str(s.path) in str(ei.value)
    assert ei.value.errno == errno.EIO and not isinstance(ei.value, hm.StoreFormatError)
    st = s.stats()["_store"]
    assert st["updates"] == twin.stats()["_store"]["updates"]
    assert same(snapshot(s), snapshot(twin))
    train(s, 5, seed=9)  # and it trains on, exactly as the twin
    train(twin, 5, seed=9)
    assert same(snapshot(s), snapshot(twin))


_CORRUPT_CHILD = textwrap.dedent("""
    import sys, torch, hiermem as hm
    try:
        s = hm.HierarchicalStore.open(sys.argv[1])
        for i in range(0, 5000, 500):
            s.lookup("t", torch.arange(i, i + 500))
        s.close()
        print("READ ALL")
    except hm.HierMemError as e:
        print(type(e).__name__, e)
""")


def test_corrupt_btree_page_is_a_typed_error(tmp_path):
    """A zeroed page in the middle of data.mdb (a bad sector): LMDB's MDB_CORRUPTED comes
    back as StoreFormatError naming the store (in a child process: LMDB maps the file)."""
    base = tmp_path / "base"
    s = hm.HierarchicalStore([hm.TableSpec("t", 5000, 16)], hm.StoreConfig(path=base, device_rows=100,
                                                                           host_rows=400))
    g = torch.Generator().manual_seed(0)
    for i in range(0, 5000, 500):
        s.write("t", torch.arange(i, i + 500), torch.randn(500, 16, generator=g))
    s.close()
    d = tmp_path / "corrupt"
    shutil.copytree(base, d, ignore=shutil.ignore_patterns("lock.mdb"))
    env = lmdb.open(str(d), readonly=True, lock=False, max_dbs=4)  # the pages in use (the file may
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]      # be allocated ahead: writemap)
    env.close()
    with open(d / "data.mdb", "r+b") as f:
        f.seek((used // 4096 // 2) * 4096)
        f.write(b"\0" * 4096)
    r = subprocess.run([sys.executable, "-c", _CORRUPT_CHILD, str(d)], capture_output=True, text=True,
                       timeout=120, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("StoreFormatError") and str(d) in r.stdout, r.stdout


# -- store files of the wrong kind -----------------------------------------------------------------
@pytest.fixture
def closed_store(tmp_path):
    s = make(tmp_path / "base")
    train(s, 20, seed=3)
    values = snapshot(s)
    s.close()
    return tmp_path / "base", values


def _variant(closed_store, tmp_path, name, fn):
    base, _ = closed_store
    d = tmp_path / name
    shutil.copytree(base, d, ignore=shutil.ignore_patterns("lock.mdb"))
    fn(d)
    return d


WRONG_KIND = {
    "data.mdb-is-a-directory": lambda d: ((d / "data.mdb").unlink(), (d / "data.mdb").mkdir()),
    "data.mdb-is-dev-zero": lambda d: ((d / "data.mdb").unlink(), (d / "data.mdb").symlink_to("/dev/zero")),
    "hiermem.lock-is-a-directory": lambda d: ((d / "hiermem.lock").unlink(), (d / "hiermem.lock").mkdir()),
    "lock.mdb-is-a-directory": lambda d: (d / "lock.mdb").mkdir(),
}


@pytest.mark.parametrize("kind", sorted(WRONG_KIND))
def test_store_file_of_the_wrong_kind_is_a_typed_error(closed_store, tmp_path, kind):
    d = _variant(closed_store, tmp_path, "v", WRONG_KIND[kind])
    for how in ("open", "init"):
        with pytest.raises(hm.StoreFormatError) as ei:
            if how == "open":
                hm.HierarchicalStore.open(d)
            else:
                make(d)
        assert str(d) in str(ei.value)


def test_garbage_lock_mdb_is_rebuilt_and_data_kept(closed_store, tmp_path):
    """lock.mdb holds only reader slots: LMDB rebuilds a garbage one; the rows are intact."""
    _, values = closed_store
    d = _variant(closed_store, tmp_path, "v", lambda d: (d / "lock.mdb").write_bytes(os.urandom(8192)))
    s = hm.HierarchicalStore.open(d)
    try:
        assert same(snapshot(s), values)
    finally:
        s.close()


# -- the store's saved policy file goes bad -----------------------------------------------------------
@pytest.mark.parametrize("change", ["deleted", "unknown-key", "unknown-params", "unknown-name", "not-toml",
                                    "a-directory"])
def test_saved_policy_file_gone_bad_is_refused_naming_it(tmp_path, change):
    pf = tmp_path / "tuned.toml"
    pf.write_text('name = "lfu"\ndescription = "tuned"\n')
    s = make(tmp_path / "s", policy=str(pf))
    train(s, 15, seed=4)
    values = snapshot(s)
    s.close()
    if change == "deleted":
        pf.unlink()
    elif change == "unknown-key":
        pf.write_text('name = "lfu"\nwindow = 3\n')
    elif change == "unknown-params":
        pf.write_text('name = "lfu"\n[params]\ndecay = 0.5\n')
    elif change == "unknown-name":
        pf.write_text('name = "clockpro"\n')
    elif change == "not-toml":
        pf.write_bytes(b"\x00\x01 not toml [[[")
    else:
        pf.unlink()
        pf.mkdir()
    with pytest.raises(hm.PolicyFileError) as ei:
        hm.HierarchicalStore.open(tmp_path / "s")
    assert str(pf) in str(ei.value)
    # nothing changed, and naming a policy reopens it
    s = hm.HierarchicalStore.open(tmp_path / "s", policy="lru")
    try:
        assert same(snapshot(s), values)
    finally:
        s.close()


# -- a kill in the middle of restore ----------------------------------------------------------
_RESTORE_CHILD = textwrap.dedent("""
    import os, signal, sys
    import hiermem as hm
    ck, path, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    calls = [0]

    def dying(real):
        def f(*a, **kw):
            calls[0] += 1
            if calls[0] == k:  # SIGKILL just before the k-th rename of the restore
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        return f
    os.rename, os.replace = dying(os.rename), dying(os.replace)
    hm.HierarchicalStore.restore(ck, path).close()
    print("RESTORED", calls[0])
""")


def test_kill_at_any_rename_of_restore_leaves_a_store_that_opens(tmp_path):
    """restore() replaces the live store: killed before any of its renames, the path must
    hold either the old store or the checkpoint, complete, never nothing."""
    base = tmp_path / "base"
    s = make(base)
    train(s, 10, seed=1)
    ck = s.checkpoint(tmp_path / "ck")
    want_ck = snapshot(s)
    train(s, 10, seed=2)
    want_old = snapshot(s)
    s.close()
    outcomes = []
    for k in range(1, 8):
        path = tmp_path / f"live{k}"
        shutil.copytree(base, path, ignore=shutil.ignore_patterns("lock.mdb"))
        r = subprocess.run([sys.executable, "-c", _RESTORE_CHILD, str(ck), str(path), str(k)], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert r.returncode in (0, -9), r.stderr[-2000:]
        st = hm.HierarchicalStore.open(path)  # must open: the old store or the checkpoint
        try:
            got = snapshot(st)
        finally:
            st.close()
        assert same(got, want_old) or same(got, want_ck), f"kill before rename {k}: neither old nor checkpoint"
        outcomes.append("old" if same(got, want_old) else "ck")
        if r.returncode == 0:
            assert outcomes[-1] == "ck"
            break
    else:
        pytest.fail("restore made more than 6 renames")
    assert "old" in outcomes and outcomes[-1] == "ck"


def test_restore_refuses_an_open_store_and_a_foreign_directory(tmp_path):
    s = make(tmp_path / "s")
    train(s, 8, seed=1)
    ck = s.checkpoint(tmp_path / "ck")
    want = snapshot(s)
    with pytest.raises(hm.HierMemError) as ei:  # replacing the file under an open store would lose its writes
        hm.HierarchicalStore.restore(ck, tmp_path / "s")
    assert "open" in str(ei.value) and str(tmp_path / "s") in str(ei.value)
    assert same(snapshot(s), want)
    s.close()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(hm.StoreFormatError) as ei:
        hm.HierarchicalStore.restore(ck, other)
    assert str(other) in str(ei.value)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary copy left
    for target in (tmp_path / "new", tmp_path / "empty"):
        if target.name == "empty":
            target.mkdir()
        r = hm.HierarchicalStore.restore(ck, target)
        try:
            assert same(snapshot(r), want)
        finally:
            r.close()


# -- a corrupt Criteo trace ---------------------------------------------------------------------
_GOOD = "\t".join(["1"] + [str(i) for i in range(12)] + [""] + ["68fd1e64"] * 25 + [""]) + "\n"
BAD_CRITEO = {
    "binary": os.urandom(4096),
    "empty": b"",
    "blank-lines": b"\n\n\n",
    "truncated-last-line": (_GOOD * 3 + _GOOD[:40]).encode(),
    "extra-field": (_GOOD.rstrip("\n") + "\textra\n").encode() * 2,
    "comma-separated": _GOOD.replace("\t", ",").encode() * 2,
    "hash-not-hex": _GOOD.replace("68fd1e64", "zzzzzzzz", 1).encode() * 2,
    "hash-too-long": _GOOD.replace("68fd1e64", "68fd1e6400", 1).encode() * 2,  # used to be cut to 8 digits
    "hash-too-short": _GOOD.replace("68fd1e64", "68fd", 1).encode() * 2,
    "label-text": ("yes" + _GOOD[1:]).encode() * 2,
    "label-not-0-1": ("7" + _GOOD[1:]).encode() * 2,  # used to be accepted
    "integer-nan": _GOOD.replace("\t3\t", "\tnan\t", 1).encode() * 2,  # used to give NaN features
    "integer-inf": _GOOD.replace("\t3\t", "\tinf\t", 1).encode() * 2,
    "integer-float": _GOOD.replace("\t3\t", "\t3.5\t", 1).encode() * 2,
    "integer-30-digits": _GOOD.replace("\t3\t", "\t" + "9" * 30 + "\t", 1).encode() * 2,  # used to be cut
    "utf8": ("é\t" * 39 + "é\n").encode(),
}


@pytest.mark.parametrize("kind", sorted(BAD_CRITEO))
def test_corrupt_criteo_trace_is_a_typed_error_naming_the_file(tmp_path, kind):
    from hiermem.nn.data import CriteoFormatError, criteo_tsv_batches

    f = tmp_path / f"{kind}.tsv"
    f.write_bytes(BAD_CRITEO[kind])
    with pytest.raises(CriteoFormatError) as ei:
        list(criteo_tsv_batches(f, 2, cycle=False))
    assert isinstance(ei.value, hm.HierMemError) and str(f) in str(ei.value)


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_unreadable_criteo_path_is_a_typed_error(tmp_path, what):
    from hiermem.nn.data import CriteoFormatError, criteo_tsv_batches

    f = tmp_path / "x.tsv"
    if what == "directory":
        f.mkdir()
    with pytest.raises(CriteoFormatError) as ei:
        next(criteo_tsv_batches(f, 2))
    assert str(f) in str(ei.value)


def test_good_criteo_lines_parse_exactly():
    from hiermem.nn.data import parse_criteo_lines

    labels, dense, cats = parse_criteo_lines([_GOOD.encode(), ("0" + _GOOD[1:]).replace("\t5\t", "\t-2\t").encode()])
    assert labels.tolist() == [1.0, 0.0]
    assert dense[0].tolist() == np.log1p(np.array(list(range(12)) + [0], dtype=np.float64)).astype(np.float32).tolist()
    assert dense[1, 5] == 0.0  # negative integers clip at 0 before log1p
    assert cats[0, :25].tolist() == [0x68FD1E64] * 25 and cats[0, 25] == -1


def test_record_of_the_wrong_width_is_a_typed_error(closed_store):
    """A table's record cut short on disk: the store's export, a lookup of that row and a
    read-only export each raise StoreFormatError naming the store, not numpy's error."""
    from hiermem.tiers.records import decode_keys, table_db

    d, _ = closed_store
    env = lmdb.open(str(d), max_dbs=16, subdir=True)
    try:
        db = env.open_db(table_db(0), integerkey=True, create=False)
        with env.begin(write=True, db=db) as txn:
            key = next(iter(txn.cursor().iternext(values=False)))
            txn.put(key, b"\0" * 12)  # 3 floats where the table's records are wider
        bad = int(decode_keys(key)[0])
    finally:
        env.close()
    s = hm.HierarchicalStore.open(d)
    try:
        for op in (lambda: s.export(TABLES[0].name), lambda: s.lookup(TABLES[0].name, torch.tensor([bad]))):
            with pytest.raises(hm.StoreFormatError) as ei:
                op()
            assert str(d) in str(ei.value) and "records are not" in str(ei.value)
    finally:
        s.close()
    with hm.HierarchicalStore.open(d, readonly=True) as r, pytest.raises(hm.StoreFormatError):
        r.export(TABLES[0].name)
