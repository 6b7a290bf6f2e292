"""Issue 19: stale temporaries, restore under the store's lock, I/O errors typed apart from
corruption, policy files' tier sizes and depth, records at each table's own width."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.store.checkpoint import READERS_LOCK, clean_stale_temporaries
from hiermem.tiers import ioerrors

TABLES = [hm.TableSpec("b", 400, 4), hm.TableSpec("h", None, 3)]


def make(path, **kw):
    kw.setdefault("device_rows", 8)
    kw.setdefault("host_rows", 24)
    return hm.HierarchicalStore(TABLES, hm.StoreConfig(path=path, optimizer=hm.Adagrad(lr=0.1), **kw))


def train(s, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 400, (12,), generator=g)
        s.lookup("b", ids)
        s.update("b", ids, torch.randn(12, 4, generator=g))


def values(s):
    return torch.cat([s.lookup("b", torch.arange(i, 400, 20)) for i in range(20)])


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def temp_dir(parent, name, files=("data.mdb",)):
    d = parent / name
    d.mkdir()
    for f in files:
        (d / f).write_bytes(b"\0" * 64)
    return d


# -- stale temporaries ---------------------------------------------------------------------
def test_checkpoint_removes_stale_temporaries_of_dead_processes_only(tmp_path):
    s = make(tmp_path / "s")
    try:
        train(s, 5)
        ck = tmp_path / "ck"
        ck.mkdir()
        dead = temp_dir(ck, f".step-3.tmp-{dead_pid()}")
        live = temp_dir(ck, f".step-4.tmp-{os.getppid()}")  # a running process: maybe still writing
        mine = temp_dir(ck, f".step-5.tmp-{os.getpid()}")
        foreign = temp_dir(ck, f".notes.tmp-{dead_pid()}", files=("data.mdb", "notes.txt"))  # not only LMDB's
        s.checkpoint(ck / "c1")
        assert not dead.exists()
        assert live.exists() and mine.exists() and foreign.exists()
        assert s.stats()["_store"]["stale_temporaries_removed"] == 1
    finally:
        s.close()


def test_open_removes_stale_restore_and_checkpoint_temporaries(tmp_path):
    s = make(tmp_path / "s")
    train(s, 5)
    ck = tmp_path / "ck"
    ck.mkdir()
    s.checkpoint(ck / "c1")  # the store remembers where it checkpoints
    s.close()
    pid = dead_pid()
    stale = [temp_dir(tmp_path, f".s.restore-{pid}"), temp_dir(tmp_path, f"..s.restore-{pid}.tmp-{pid}"),
             temp_dir(ck, f".c2.tmp-{pid}", files=())]
    other = temp_dir(tmp_path, f".t.restore-{pid}")  # another store's: not this store's to judge
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        assert not any(d.exists() for d in stale)
        assert other.exists()
        assert s.stats()["_store"]["stale_temporaries_removed"] == 3
    finally:
        s.close()


def test_pid_reused_by_a_later_process_counts_as_gone(tmp_path):
    d = temp_dir(tmp_path, f".x.tmp-{os.getppid()}")
    os.utime(d, (1_000_000, 1_000_000))  # written in 1970: the parent process started later
    assert clean_stale_temporaries(tmp_path) == [d]


# -- restore takes the lock ------------------------------------------------------------------
@pytest.mark.parametrize("holder", ["writer", "reader"])
def test_restore_refuses_a_store_open_in_another_process(tmp_path, holder):
    """flock is per open file description, so a second descriptor here stands in for
    another process holding the store's lock (a writer) or the readers' lock shared."""
    s = make(tmp_path / "s")
    train(s, 5)
    s.checkpoint(tmp_path / "ck")
    train(s, 5, seed=1)
    want = values(s)
    s.close()
    before = (tmp_path / "s" / "data.mdb").read_bytes()
    name, how = ("hiermem.lock", fcntl.LOCK_EX) if holder == "writer" else (READERS_LOCK, fcntl.LOCK_SH)
    fd = os.open(tmp_path / "s" / name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        with pytest.raises(hm.HierMemError) as ei:
            hm.HierarchicalStore.restore(tmp_path / "ck", tmp_path / "s")
        assert "restoring" in str(ei.value)
        assert (tmp_path / "s" / "data.mdb").read_bytes() == before  # untouched
    finally:
        os.close(fd)
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        assert torch.equal(values(s), want)
    finally:
        s.close()


def test_restore_hands_its_lock_to_the_store_it_opens(tmp_path):
    s = make(tmp_path / "s")
    train(s, 5)
    s.checkpoint(tmp_path / "ck")
    want = values(s)
    train(s, 5, seed=1)
    s.close()
    r = hm.HierarchicalStore.restore(tmp_path / "ck", tmp_path / "s")
    try:
        fd = os.open(tmp_path / "s" / "hiermem.lock", os.O_RDWR)
        try:  # the restored store holds the lock: another process could not take it
            with pytest.raises(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert torch.equal(values(r), want)
    finally:
        r.close()
    from hiermem.store.locks import HANDOFF as _HANDOFF
    assert not _HANDOFF


# -- I/O errors typed apart from corruption --------------------------------------------------
class _Env:
    """The store's LMDB environment with the next ``reads`` read transactions and the
    next ``commits`` commits failing with EIO."""

    def __init__(self, env, reads=0, commits=0):
        self._env, self.reads, self.commits, self.calls = env, reads, commits, 0

    def begin(self, *a, **kw):
        if kw.get("write"):
            env = self

            class Txn:
                def __enter__(self):
                    self.t = env._env.begin(*a, **kw)
                    return self.t

                def __exit__(self, et, ev, tb):
                    if et is None and env.commits:
                        env.commits -= 1
                        self.t.abort()
                        raise lmdb.Error("mdb_txn_commit: Input/output error")
                    return self.t.__exit__(et, ev, tb)
            return Txn()
        self.calls += 1
        if self.reads:
            self.reads -= 1
            raise lmdb.Error("mdb_txn_begin: Input/output error")
        return self._env.begin(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


FRESH = torch.arange(40, 80)


def test_read_eio_is_a_store_io_error_with_errno_not_corruption(tmp_path):
    s = make(tmp_path / "s", device_rows=40, host_rows=40)
    try:
        train(s, 10)
        s.flush()
        s.lookup("b", torch.arange(300, 380))  # evict every row of FRESH to disk
        real = s._disk.env
        s._disk.env = fake = _Env(real, reads=100)
        try:
            with pytest.raises(hm.StoreIOError) as ei:
                s.lookup("b", FRESH)
        finally:
            s._disk.env = real
        e = ei.value
        assert not isinstance(e, hm.StoreFormatError) and isinstance(e, OSError)
        assert e.errno == errno.EIO and str(s.path) in str(e) and "not known to be corrupt" in str(e)
        assert fake.calls == ioerrors.READ_ATTEMPTS  # retried, then typed
        s.lookup("b", FRESH)  # nothing changed: it reads on
    finally:
        s.close()


def test_transient_read_eio_is_retried(tmp_path):
    s = make(tmp_path / "s", device_rows=40, host_rows=40)
    try:
        train(s, 10)
        s.lookup("b", torch.arange(300, 380))
        want_where = s.where("b", FRESH)
        real = s._disk.env
        s._disk.env = _Env(real, reads=ioerrors.READ_ATTEMPTS - 1)
        try:
            got = s.lookup("b", FRESH)
        finally:
            s._disk.env = real
        assert got.shape == (40, 4) and int((want_where == hm.Tier.DISK).sum()) > 0
    finally:
        s.close()


@pytest.mark.parametrize("failures", [1, 2])
def test_commit_eio_is_retried_once_then_typed(tmp_path, failures):
    s = make(tmp_path / "s")
    try:
        train(s, 10)
        want = values(s)
        real = s._disk.env
        s._disk.env = _Env(real, commits=failures)
        try:
            if failures == 1:
                s.flush()  # the retry commits it
            else:
                with pytest.raises(hm.StoreIOError) as ei:
                    s.flush()
                assert ei.value.errno == errno.EIO and not isinstance(ei.value, hm.DiskFullError)
        finally:
            s._disk.env = real
        s.close()
        s = hm.HierarchicalStore.open(tmp_path / "s")
        assert torch.equal(values(s), want)
    finally:
        s.close()


def test_corrupt_error_stays_a_format_error():
    e = ioerrors.typed("/x", lmdb.CorruptedError("mdb_get", -30796), "read")
    assert isinstance(e, hm.StoreFormatError) and not isinstance(e, hm.StoreIOError)
    assert isinstance(ioerrors.typed("/x", lmdb.Error("mdb_txn_commit: Input/output error"), "write"),
                      hm.StoreIOError)


# -- policy files ------------------------------------------------------------------------------
def policy(tmp_path, text, name="tuned.toml"):
    p = tmp_path / name
    p.write_text('name = "lfu"\n' + text)
    return str(p)


def test_policy_file_sizes_and_depth_apply_and_explicit_arguments_win(tmp_path):
    pf = policy(tmp_path, "device_rows = 16\nhost_rows = 48\nprefetch_depth = 3\n")
    c = hm.StoreConfig(path=tmp_path / "s", policy=pf).resolved()  # a config reads no file itself
    assert (c.device_rows, c.host_rows, c.prefetch_depth) == (16, 48, 3)
    c = hm.StoreConfig(path=tmp_path / "s", policy=pf, device_rows=9, prefetch_depth=1).resolved()
    assert (c.device_rows, c.host_rows, c.prefetch_depth) == (9, 48, 1)
    c = hm.StoreConfig(path=tmp_path / "s")
    assert (c.device_rows, c.host_rows, c.prefetch_depth) == (10_000, 100_000, 2)
    with hm.HierarchicalStore(TABLES, hm.StoreConfig(path=tmp_path / "s", policy=pf)) as s:
        st = s.stats()["_store"]
        assert (st["device_capacity"], st["host_capacity"], st["prefetch_depth"]) == (16, 48, 3)
        module = hm.CachedEmbeddingBagCollection(TABLES, store=s)
        with hm.PrefetchPipeline(iter([]), module) as pipe:
            assert pipe.depth == 3
    # reopened: the sizes it ran with were recorded; a new policy file given now applies its own
    with hm.HierarchicalStore.open(tmp_path / "s") as s:
        assert (s.config.device_rows, s.config.host_rows, s.config.prefetch_depth) == (16, 48, 3)
    pf2 = policy(tmp_path, "device_rows = 20\nprefetch_depth = 1\n", "other.toml")
    with hm.HierarchicalStore.open(tmp_path / "s", policy=pf2) as s:
        assert (s.config.device_rows, s.config.host_rows, s.config.prefetch_depth) == (20, 48, 1)
    with hm.HierarchicalStore.open(tmp_path / "s", policy=pf2, device_rows=30) as s:
        assert s.config.device_rows == 30


@pytest.mark.parametrize("text,key", [("device_rows = 0\n", "device_rows"), ('host_rows = "big"\n', "host_rows"),
                                      ("prefetch_depth = -1\n", "prefetch_depth"),
                                      ("device_rows = 2.5\n", "device_rows")])
def test_bad_policy_sizes_are_refused_by_name(tmp_path, text, key):
    pf = policy(tmp_path, text)
    with pytest.raises(hm.PolicyFileError) as ei:
        hm.StoreConfig(path=tmp_path / "s", policy=pf).resolved()
    assert key in str(ei.value) and pf in str(ei.value)
    assert not (tmp_path / "s").exists()


def test_depth_zero_in_policy_file_refuses_a_pipeline_by_name(tmp_path):
    pf = policy(tmp_path, "prefetch_depth = 0\n")
    with hm.HierarchicalStore(TABLES, hm.StoreConfig(path=tmp_path / "s", policy=pf, device_rows=8,
                                                     host_rows=24)) as s:
        module = hm.CachedEmbeddingBagCollection(TABLES, store=s)
        with pytest.raises(hm.InvalidArgumentError) as ei:
            hm.PrefetchPipeline(iter([]), module)
        assert "prefetch_depth = 0" in str(ei.value)
        hm.PrefetchPipeline(iter([]), module, depth=2).close()  # an explicit depth wins


def test_cli_demo_takes_sizes_from_the_policy_file_and_shows_them(tmp_path, capsys):
    from hiermem.cli.main import _policy_sizes, build_parser

    pf = policy(tmp_path, "device_rows = 64\nhost_rows = 256\nprefetch_depth = 1\n")
    a = build_parser().parse_args(["demo", "--policy", pf])
    assert _policy_sizes(a) == {"device_rows": 64, "host_rows": 256, "depth": 1}
    assert f"device_rows=64 ({pf})" in capsys.readouterr().err
    a = build_parser().parse_args(["demo", "--policy", pf, "--device-rows", "32"])
    assert _policy_sizes(a) == {"device_rows": 32, "host_rows": 256, "depth": 1}
    assert "device_rows=32 (argument)" in capsys.readouterr().err
    a = build_parser().parse_args(["demo"])  # no file: the demo's defaults (or a resumed run's)
    assert _policy_sizes(a) == {"device_rows": None, "host_rows": None, "depth": None}


# -- records at each table's own width -----------------------------------------------------------
def test_disk_records_are_at_each_tables_own_width(tmp_path):
    tables = [hm.TableSpec("wide", 50, 128)] + [hm.TableSpec(f"n{i}", 50, 8) for i in range(3)]
    opt = hm.Adagrad(lr=0.1)
    with hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device_rows=64, host_rows=64,
                                                     optimizer=opt)) as s:
        for t in tables:
            s.write(t.name, torch.arange(50), torch.ones(50, t.dim))
    env = lmdb.open(str(tmp_path / "s"), readonly=True, lock=False, max_dbs=16)
    try:
        sizes = {}
        for i in range(len(tables)):
            db = env.open_db(b"t%d" % i, create=False, integerkey=True)
            with env.begin(db=db) as txn:
                for k, v in txn.cursor():
                    sizes.setdefault(i, set()).add(len(v))
    finally:
        env.close()
    assert sizes == {i: {4 * (t.dim + opt.state_width(t.dim))} for i, t in enumerate(tables)}
    assert np.dtype("<f4").itemsize == 4


# -- lock files: one way of taking them, typed errors everywhere ---------------------------
@pytest.mark.parametrize("who", ["open", "readonly", "restore"])
def test_a_lock_file_that_is_a_directory_is_a_format_error_everywhere(tmp_path, who):
    """The writer's open, a read-only open and restore all type a lock file's path that is
    a directory as a foreign store (read-only opens raised a plain HierMemError)."""
    s = make(tmp_path / "s")
    train(s, 3)
    s.checkpoint(tmp_path / "ck")
    s.close()
    name = READERS_LOCK if who in ("readonly", "restore") else "hiermem.lock"
    (tmp_path / "s" / name).unlink(missing_ok=True)
    (tmp_path / "s" / name).mkdir()
    with pytest.raises(hm.StoreFormatError, match="is a directory"):
        if who == "open":
            hm.HierarchicalStore.open(tmp_path / "s")
        elif who == "readonly":
            hm.HierarchicalStore.open(tmp_path / "s", readonly=True)
        else:
            hm.HierarchicalStore.restore(tmp_path / "ck", tmp_path / "s")
    assert (tmp_path / "s" / name).is_dir()  # nothing changed


def test_an_unopenable_lock_file_is_a_typed_error(tmp_path):
    """An OS error opening a lock file (here: a dangling symlink into a missing
    directory) is a HierMemError naming the file, for restore too (it raised a raw
    OSError)."""
    from hiermem.store import locks

    d = tmp_path / "d"
    d.mkdir()
    (d / "x.lock").symlink_to(tmp_path / "missing" / "x")
    with pytest.raises(hm.HierMemError, match="cannot open the lock file x.lock"):
        locks.take(d, "x.lock", True, "busy")
    fd = locks.take(d, "y.lock", False, "busy")
    try:  # shared locks share; an exclusive one is refused with the caller's words
        os.close(locks.take(d, "y.lock", False, "busy"))
        with pytest.raises(hm.HierMemError, match="busy"):
            locks.take(d, "y.lock", True, "busy")
    finally:
        os.close(fd)


def test_a_config_reads_no_file_until_resolved(tmp_path):
    """StoreConfig is a value: naming a policy file reads nothing (a missing file is not
    noticed) until resolved(), which the store calls when it opens."""
    pf = str(tmp_path / "later.toml")
    c = hm.StoreConfig(path=tmp_path / "s", policy=pf)
    assert (c.device_rows, c.host_rows, c.prefetch_depth) == (None, None, None) and c.policy_file
    with pytest.raises(hm.PolicyFileError):
        c.resolved()
    with pytest.raises(hm.PolicyFileError):
        hm.HierarchicalStore(TABLES, c)
    assert not (tmp_path / "s").exists()
    policy(tmp_path, "device_rows = 12\n", "later.toml")
    assert c.resolved().device_rows == 12 and c.resolved().host_rows == 100_000
    d = hm.StoreConfig(path=tmp_path / "s", policy="lfu")
    assert not d.policy_file and d.resolved() is d and d.device_rows == 10_000
