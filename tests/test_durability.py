"""Durability of a HierarchicalStore: flush + hard kill, close/open roundtrips, layout
checks on reopen, refusing paths that are not hiermem stores, file permissions, LMDB map
growth and disk-full handling.

Everything runs on the CPU with tiny tiers (device_rows=4, host_rows=16) so that rows of
a few hundred ids are spread over the device, host and LMDB tiers.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm

DEV, HOST = 4, 16  # tiny tiers: at most 20 rows resident


# -- helpers -----------------------------------------------------------------------------
def tables():
    # two tables of different dims, so records of the narrower one are padded in the tiers
    return [hm.TableSpec("bounded", 120, 8), hm.TableSpec("hashed", None, 5)]


HASHED_IDS = [(i * 0x9E3779B97F4A7C15) % (2**63) for i in range(59)] + [2**63 - 1]


def universe():
    """Every id the tests touch: table -> int64 ids."""
    return {"bounded": torch.arange(120), "hashed": torch.tensor(HASHED_IDS, dtype=torch.int64)}


def snapshot(store, ids_by_table=None, chunk=DEV + HOST):
    """Values of all rows (lookups in chunks that fit the tiers); residency changes, values don't."""
    out = {}
    for name, ids in (ids_by_table or universe()).items():
        parts = [store.lookup(name, ids[i:i + chunk]).clone() for i in range(0, ids.numel(), chunk)]
        out[name] = torch.cat(parts) if parts else torch.empty(0)
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"table {name}: values differ"


def raw_records(path):
    """All rows of a (closed) store as {(table database, key bytes): value bytes}, plus its
    metadata."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        meta_db = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            names = [k for k, _ in txn.cursor() if k != b"meta"]
        dbs = {n: env.open_db(n, create=False, integerkey=True) for n in names}
        with env.begin() as txn:
            rows = {(n, k): v for n, db in dbs.items() for k, v in txn.cursor(db=db)}
            meta = json.loads(txn.get(b"store", db=meta_db))
    finally:
        env.close()
    return rows, meta


def workload(store, steps, seed, write_every=7):
    """A deterministic training loop: lookups, updates whose gradients depend on the looked-up
    values (so any lost or wrong row or optimizer state changes what follows), and writes."""
    g = torch.Generator().manual_seed(seed)
    u = universe()
    for step in range(steps):
        name = "bounded" if step % 3 else "hashed"
        pool = u[name]
        ids = pool[torch.randint(0, pool.numel(), (12,), generator=g)]  # duplicates included
        dim = store.tables[store.table_index(name)].dim
        if step % write_every == write_every - 1:
            store.write(name, ids, torch.randn(ids.numel(), dim, generator=g))
            continue
        emb = store.lookup(name, ids)
        grads = 0.5 * emb + 0.1 * torch.randn(emb.shape, generator=g)
        store.update(name, ids, grads)


def make_store(path, optimizer=None, seed=7, **kw):
    cfg = hm.StoreConfig(path=path, device_rows=kw.pop("device_rows", DEV), host_rows=kw.pop("host_rows", HOST),
                         optimizer=optimizer or hm.SGD(lr=0.1), seed=seed, **kw)
    return hm.HierarchicalStore(tables(), cfg)


def copy_store(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock.mdb"))
    return dst


@pytest.fixture(scope="module")
def _populated_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("populated") / "store"
    s = make_store(path, optimizer=hm.Adagrad(lr=0.05))
    workload(s, 40, seed=1)
    values = snapshot(s)
    s.close()
    return path, values


@pytest.fixture
def populated(_populated_template, tmp_path):
    """A closed store at tmp_path/'store' after some training (Adagrad), and its values."""
    src, values = _populated_template
    return copy_store(src, tmp_path / "store"), values


# -- flush, then SIGKILL -----------------------------------------------------------------
CHILD = textwrap.dedent(r"""
    import json, os, sys
    import torch
    import hiermem as hm

    path, outdir, combine = sys.argv[1], sys.argv[2], int(sys.argv[3])
    T = [hm.TableSpec("bounded", 120, 8), hm.TableSpec("hashed", None, 5)]
    HASHED = [(i * 0x9E3779B97F4A7C15) % (2**63) for i in range(59)] + [2**63 - 1]
    U = {"bounded": torch.arange(120), "hashed": torch.tensor(HASHED, dtype=torch.int64)}
    store = hm.HierarchicalStore(T, hm.StoreConfig(path=path, device_rows=4, host_rows=16,
                                                   optimizer=hm.SGD(lr=0.1), seed=3, write_combine=combine))
    g = torch.Generator().manual_seed(0)
    log = open(os.path.join(outdir, "later.jsonl"), "w")

    def op(step, ranges, record):
        name = "bounded" if step % 3 else "hashed"
        lo, hi = ranges[name]
        ids = U[name][lo + torch.randint(0, hi - lo, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g)]
        dim = T[0].dim if name == "bounded" else T[1].dim
        kind = step % 4
        if kind == 0:
            store.lookup(name, ids)
            return
        if kind == 3:
            store.write(name, ids, torch.randn(ids.numel(), dim, generator=g))
        else:
            emb = store.lookup(name, ids)
            store.update(name, ids, emb * 0.3 + torch.randn(emb.shape, generator=g))
        if record:
            # the values the rows hold now; they reach LMDB only during a later call
            # (rows of this batch are never evicted by the lookup below), so logging
            # them before the next call records every value LMDB may end up with
            v = store.lookup(name, ids)
            rows = {int(i): v[j].tolist() for j, i in enumerate(ids.tolist())}
            log.write(json.dumps({"step": step, "table": name, "rows": rows}) + "\n")
            log.flush()

    # before the flush: bounded 0..89, hashed 0..44 (bounded 90..119, hashed 45..59 stay INIT)
    for step in range(120):
        op(step, {"bounded": (0, 90), "hashed": (0, 45)}, record=False)
    store.flush()
    tiers = {}
    for name, ids in U.items():
        w = store.where(name, ids).tolist()
        tiers[name] = {t.label: w.count(int(t)) for t in hm.Tier}
    flushed = {}
    for name, ids in U.items():  # chunks fit the tiers; all rows are clean, nothing is written
        flushed[name] = torch.cat([store.lookup(name, ids[i:i + 20]) for i in range(0, ids.numel(), 20)]).tolist()
    with open(os.path.join(outdir, "flushed.json.tmp"), "w") as f:
        json.dump({"tiers": tiers, "flushed": flushed}, f)
    os.replace(os.path.join(outdir, "flushed.json.tmp"), os.path.join(outdir, "flushed.json"))
    print("READY", flush=True)
    # after the flush, never flushed: bounded 60..119, hashed 30..59 (so bounded 0..59 and
    # hashed 0..29 are never modified again)
    step = 120
    while step < 100000:
        op(step, {"bounded": (60, 120), "hashed": (30, 60)}, record=True)
        print("OP", step - 120, store.stats()["_store"]["bytes_host_to_disk"], flush=True)
        step += 1
    print("IDLE", flush=True)
    import time
    time.sleep(600)
""")


def _read_line(proc, deadline):
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("child did not report in time")
        r, _, _ = select.select([proc.stdout], [], [], left)
        if r:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"child exited early (rc={proc.wait()}): {proc.stderr.read()[-3000:]}")
            return line.split()


KILL_AFTER = 60  # unflushed operations the child makes (at least) before it is killed


@pytest.mark.parametrize("combine", [0, 16], ids=["each-write-back", "combined"])
def test_flush_then_sigkill_keeps_flushed_values(tmp_path, combine):
    """Write-backs committed one by one, or combined 16 records at a time (those held
    when the process dies are lost, as the promise allows)."""
    path, outdir = tmp_path / "store", tmp_path / "out"
    outdir.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(path), str(outdir), str(combine)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    try:
        deadline = time.monotonic() + 120
        assert _read_line(proc, deadline) == ["READY"]
        # let it run unflushed updates (with dirty rows written down on eviction) past
        # KILL_AFTER operations, then kill it, most likely in the middle of one
        while True:
            words = _read_line(proc, deadline)
            if words[0] == "OP" and int(words[1]) >= KILL_AFTER and int(words[2]) > 0:
                break
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    info = json.loads((outdir / "flushed.json").read_text())
    # the flushed state really had rows in every tier
    for name in ("bounded", "hashed"):
        t = info["tiers"][name]
        assert t["disk"] > 0 and t["init"] > 0, info["tiers"]
    assert sum(info["tiers"][n]["device"] for n in info["tiers"]) == DEV
    assert sum(info["tiers"][n]["host"] for n in info["tiers"]) == HOST

    later: dict[tuple[str, int], list[torch.Tensor]] = {}
    for line in (outdir / "later.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # the last line may be cut by the kill; its values never reached LMDB
            continue
        for i, v in rec["rows"].items():
            later.setdefault((rec["table"], int(i)), []).append(torch.tensor(v, dtype=torch.float32))
    assert later, "the child made no unflushed modifications"

    store = hm.HierarchicalStore.open(path)
    try:
        got = snapshot(store)
        n_later = 0
        for name, ids in universe().items():
            flushed = torch.tensor(info["flushed"][name], dtype=torch.float32)
            for j, i in enumerate(ids.tolist()):
                key = (name, i)
                if key not in later:
                    assert torch.equal(got[name][j], flushed[j]), f"{key}: not the flushed value"
                elif not torch.equal(got[name][j], flushed[j]):
                    assert any(torch.equal(got[name][j], v) for v in later[key]), \
                        f"{key}: neither the flushed value nor a value the store held later"
                    n_later += 1
        # rows written down on eviction after the flush are on disk (LMDB commits are durable)
        assert n_later > 0
        # the store is usable after the crash
        workload(store, 10, seed=5)
        store.flush()
    finally:
        store.close()
    # the unmodified rows were untouched by the crash, whichever ids the store saw later
    assert set(k for k in later if k[0] == "bounded") <= {("bounded", i) for i in range(60, 120)}


# -- close / open roundtrip ----------------------------------------------------------------
OPTIMIZERS = [
    hm.SGD(lr=0.05),
    hm.Adagrad(lr=0.05, initial_accumulator_value=0.1),
    hm.RowWiseAdagrad(lr=0.05, eps=1e-6),
    hm.Adam(lr=0.01, beta1=0.8, beta2=0.99),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_close_open_roundtrip_continues_training_exactly(tmp_path, opt):
    a = make_store(tmp_path / "a", optimizer=opt)
    b = make_store(tmp_path / "b", optimizer=opt)  # never closed in the middle
    workload(a, 20, seed=11)
    workload(b, 20, seed=11)
    before = snapshot(a)
    a.close()
    a = hm.HierarchicalStore.open(tmp_path / "a")
    assert a.optimizer == opt and a.config.seed == 7
    assert [t.to_dict() for t in a.tables] == [t.to_dict() for t in tables()]
    assert_same(snapshot(a), before)
    workload(a, 20, seed=12)
    workload(b, 20, seed=12)
    assert_same(snapshot(a), snapshot(b))
    a.close()
    b.close()
    # weights *and* optimizer state of every row, and the per-table step counts, agree
    ra, ma = raw_records(tmp_path / "a")
    rb, mb = raw_records(tmp_path / "b")
    assert ra == rb
    assert ma["steps"] == mb["steps"] and ma["optimizer"] == mb["optimizer"] == opt.to_dict()


def test_close_is_idempotent_and_reopen_twice(populated):
    path, values = populated
    for _ in range(2):
        s = hm.HierarchicalStore.open(path)
        assert_same(snapshot(s), values)
        s.close()
        s.close()
        assert s.closed


def test_reopen_with_constructor_same_layout(populated):
    path, values = populated
    s = hm.HierarchicalStore(tables(), hm.StoreConfig(path=path, device_rows=3, host_rows=5,
                                                      optimizer=hm.Adagrad(lr=0.05), seed=7))
    try:
        assert_same(snapshot(s, chunk=8), values)
    finally:
        s.close()


@pytest.mark.parametrize("overrides", [
    {"device_rows": 2},
    {"host_rows": 64},
    {"device_rows": 64, "host_rows": 300},
    {"policy": "lfu"},
    {"device_rows": 1, "host_rows": 11, "policy": "lfu"},
    {"map_size": 1 << 21},
], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_reopen_with_overrides_keeps_values(populated, overrides):
    path, values = populated
    s = hm.HierarchicalStore.open(path, **overrides)
    try:
        st = s.stats()["_store"]
        assert st["device_capacity"] == overrides.get("device_rows", DEV)
        assert st["host_capacity"] == overrides.get("host_rows", HOST)
        assert st["policy"] == overrides.get("policy", "lru")
        chunk = min(20, st["device_capacity"] + st["host_capacity"])
        assert_same(snapshot(s, chunk=chunk), values)
        workload(s, 10, seed=3)  # and it trains with the new tiers
        after = snapshot(s, chunk=chunk)
    finally:
        s.close()
    s = hm.HierarchicalStore.open(path)  # the saved config now has the new capacities
    try:
        assert_same(snapshot(s, chunk=chunk), after)
    finally:
        s.close()


def test_reopen_with_policy_file_override(populated, tmp_path):
    path, values = populated
    pf = tmp_path / "policy.toml"
    pf.write_text('name = "lfu"\ndescription = "frequency"\n')
    s = hm.HierarchicalStore.open(path, policy=str(pf))
    try:
        assert s.stats()["_store"]["policy"] == "lfu"
        assert_same(snapshot(s), values)
    finally:
        s.close()


def test_reopen_store_with_relative_policy_file_from_another_cwd(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "policy.toml").write_text('name = "lfu"\n')
    monkeypatch.chdir(work)
    s = hm.HierarchicalStore(tables(), hm.StoreConfig(path=tmp_path / "store", device_rows=DEV, host_rows=HOST,
                                                      policy="policy.toml"))
    workload(s, 10, seed=1)
    values = snapshot(s)
    s.close()
    monkeypatch.chdir(tmp_path)
    s = hm.HierarchicalStore.open(tmp_path / "store")
    try:
        assert s.stats()["_store"]["policy"] == "lfu"
        assert_same(snapshot(s), values)
    finally:
        s.close()


def test_open_rejects_layout_overrides(populated):
    path, _ = populated
    for bad in ({"seed": 1}, {"optimizer": hm.SGD()}, {"tables": []}, {"dim": 3}):
        with pytest.raises(hm.InvalidArgumentError):
            hm.HierarchicalStore.open(path, **bad)


# -- layout mismatch -----------------------------------------------------------------------
def _variant(kind):
    t = tables()
    opt, seed = hm.Adagrad(lr=0.05), 7
    if kind == "dim":
        t[0] = hm.TableSpec("bounded", 120, 9)
    elif kind == "num_rows":
        t[0] = hm.TableSpec("bounded", 121, 8)
    elif kind == "bounded_to_unbounded":
        t[0] = hm.TableSpec("bounded", None, 8)
    elif kind == "name":
        t[1] = hm.TableSpec("hashed2", None, 5)
    elif kind == "extra_table":
        t.append(hm.TableSpec("more", 10, 8))
    elif kind == "missing_table":
        t = t[:1]
    elif kind == "order":
        t = t[::-1]
    elif kind == "init_bound":
        t[0] = hm.TableSpec("bounded", 120, 8, init_bound=0.5)
    elif kind == "optimizer":
        opt = hm.SGD(lr=0.05)
    elif kind == "optimizer_params":
        opt = hm.Adagrad(lr=0.06)
    elif kind == "seed":
        seed = 8
    else:
        raise AssertionError(kind)
    return t, opt, seed


@pytest.mark.parametrize("kind", ["dim", "num_rows", "bounded_to_unbounded", "name", "extra_table", "missing_table",
                                  "order", "init_bound", "optimizer", "optimizer_params", "seed"])
def test_different_layout_is_refused(populated, kind):
    path, values = populated
    t, opt, seed = _variant(kind)
    with pytest.raises(hm.LayoutMismatchError) as ei:
        hm.HierarchicalStore(t, hm.StoreConfig(path=path, device_rows=DEV, host_rows=HOST, optimizer=opt, seed=seed))
    assert isinstance(ei.value, hm.StoreFormatError)
    assert str(path) in str(ei.value)
    # the refusal changed nothing and released the path
    s = hm.HierarchicalStore.open(path)
    try:
        assert_same(snapshot(s), values)
    finally:
        s.close()


# -- paths that are not hiermem stores -------------------------------------------------------
def _open_both(path):
    """Both ways of opening a path; returns the two exceptions (or None)."""
    errs = []
    for how in ("open", "init"):
        try:
            if how == "open":
                s = hm.HierarchicalStore.open(path)
            else:
                s = hm.HierarchicalStore(tables(), hm.StoreConfig(path=path, device_rows=DEV, host_rows=HOST))
        except Exception as e:  # noqa: BLE001 - inspected below
            errs.append(e)
        else:
            s.close()
            errs.append(None)
    return errs


def test_plain_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"hello")
    for e in _open_both(f):
        assert isinstance(e, hm.StoreFormatError), e
        assert str(f) in str(e)
    assert f.read_bytes() == b"hello"


def test_empty_dir_and_missing_path_are_refused_by_open(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "missing"
    for p in (empty, missing):
        with pytest.raises(hm.StoreFormatError) as ei:
            hm.HierarchicalStore.open(p)
        assert str(p) in str(ei.value)
    assert list(empty.iterdir()) == []  # open() creates nothing
    assert not missing.exists()


def test_garbage_data_mdb_is_refused(tmp_path):
    d = tmp_path / "garbage"
    d.mkdir()
    junk = np.random.default_rng(0).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()
    (d / "data.mdb").write_bytes(junk)
    for e in _open_both(d):
        assert isinstance(e, hm.StoreFormatError), e
        assert str(d) in str(e)
    assert (d / "data.mdb").read_bytes() == junk


def _foreign(path, keys):
    env = lmdb.open(str(path), map_size=1 << 20)
    with env.begin(write=True) as txn:
        for k in keys:
            txn.put(k, b"value of " + k)
    env.close()


def _main_keys(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [k for k, _ in txn.cursor()]
    finally:
        env.close()


@pytest.mark.parametrize("keys", [[b"alpha", b"beta"], [b"rows"], [b"meta", b"zzz"]], ids=["plain", "rows", "meta"])
def test_foreign_lmdb_is_refused(tmp_path, keys):
    d = tmp_path / "foreign"
    _foreign(d, keys)
    for e in _open_both(d):
        assert isinstance(e, hm.StoreFormatError), e
        assert str(d) in str(e)


def test_refusing_foreign_lmdb_does_not_modify_it(tmp_path):
    d = tmp_path / "foreign"
    _foreign(d, [b"alpha", b"beta"])
    before = _main_keys(d)
    _open_both(d)
    assert _main_keys(d) == before


def test_empty_foreign_lmdb_is_refused_by_open(tmp_path):
    d = tmp_path / "blank"
    lmdb.open(str(d), map_size=1 << 20).close()
    with pytest.raises(hm.StoreFormatError) as ei:
        hm.HierarchicalStore.open(d)
    assert str(d) in str(ei.value)


def _bad_meta(path, raw):
    env = lmdb.open(str(path), map_size=1 << 20, max_dbs=4)
    env.open_db(b"t0", integerkey=True)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"store", raw, db=meta)
    env.close()


@pytest.mark.parametrize("raw", [
    b"{not json",
    b"[1, 2]",
    json.dumps({"format": "something-else", "version": 1}).encode(),
    json.dumps({"format": "hiermem-store", "version": 3}).encode(),
    json.dumps({"format": "hiermem-store", "version": 2}).encode(),  # no layout
], ids=["not-json", "not-object", "format", "version", "no-layout"])
def test_corrupt_metadata_is_refused(tmp_path, raw):
    d = tmp_path / "meta"
    _bad_meta(d, raw)
    for e in _open_both(d):
        assert isinstance(e, hm.StoreFormatError), e
        assert str(d) in str(e)


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "store"
    s = hm.HierarchicalStore([hm.TableSpec("t", 5000, 16)], hm.StoreConfig(path=path, device_rows=1000,
                                                                           host_rows=4000))
    g = torch.Generator().manual_seed(0)
    for i in range(0, 5000, 1000):
        s.write("t", torch.arange(i, i + 1000), torch.randn(1000, 16, generator=g))
    s.close()
    assert (path / "data.mdb").stat().st_size > 200_000
    return path


def _truncated(big_store, tmp_path, size):
    d = tmp_path / f"trunc{size}"
    shutil.copytree(big_store, d)
    (d / "lock.mdb").unlink()
    if size < 0:  # half the pages in use (with writemap the file is longer: allocated ahead)
        env = lmdb.open(str(d), readonly=True, lock=False, max_dbs=4)
        size = (env.info()["last_pgno"] + 1) * env.stat()["psize"] // 2
        env.close()
    os.truncate(d / "data.mdb", size)
    return d


@pytest.mark.parametrize("size", [0, 100, 4096])
def test_truncated_data_mdb_is_refused(big_store, tmp_path, size):
    d = _truncated(big_store, tmp_path, size)
    for e in _open_both(d):
        assert isinstance(e, hm.StoreFormatError), e
        assert str(d) in str(e)


_OPEN_CHILD = textwrap.dedent("""
    import sys, hiermem as hm, torch
    try:
        s = hm.HierarchicalStore.open(sys.argv[1])
        s.lookup("t", torch.arange(100))
        print("OPENED")
    except hm.StoreFormatError as e:
        print("StoreFormatError", e)
""")


def test_truncated_data_mdb_past_meta_pages_is_refused(big_store, tmp_path):
    # in child processes (in parallel), as the bug kills the process
    dirs = [_truncated(big_store, tmp_path, size) for size in (8192, 16384, -1)]  # -1: half its pages
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_CHILD, str(d)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for d in dirs]
    results = [(d, p.returncode, out) for d, p in zip(dirs, procs) for out, _ in [p.communicate(timeout=120)]]
    for d, rc, out in results:
        assert rc == 0, f"{d.name}: child died with {rc} (SIGBUS is {-signal.SIGBUS})"
        assert out.startswith("StoreFormatError") and str(d) in out, out


# -- opening twice ----------------------------------------------------------------------------
def test_opening_twice_in_one_process_is_refused(populated):
    path, values = populated
    s = hm.HierarchicalStore.open(path)
    try:
        with pytest.raises(hm.HierMemError) as ei:
            hm.HierarchicalStore(tables(), hm.StoreConfig(path=path, device_rows=DEV, host_rows=HOST,
                                                          optimizer=hm.Adagrad(lr=0.05), seed=7))
        assert str(path) in str(ei.value) and "already open" in str(ei.value)
        with pytest.raises(hm.HierMemError) as ei:
            hm.HierarchicalStore.open(path)
        assert str(path) in str(ei.value)
        with pytest.raises(hm.HierMemError):  # another spelling of the same directory
            hm.HierarchicalStore.open(Path(str(path.parent) + "/./" + path.name))
        # the first store is unharmed
        assert_same(snapshot(s), values)
        workload(s, 5, seed=2)
        values = snapshot(s)
    finally:
        s.close()
    s = hm.HierarchicalStore.open(path)  # and the path was released
    try:
        assert_same(snapshot(s), values)
    finally:
        s.close()


def test_open_twice_is_not_reported_as_a_format_error(populated):
    path, _ = populated
    s = hm.HierarchicalStore.open(path)
    try:
        with pytest.raises(hm.HierMemError) as ei:
            hm.HierarchicalStore.open(path)
        assert not isinstance(ei.value, hm.StoreFormatError), ei.value
        assert "store is already open in this process" in str(ei.value)
    finally:
        s.close()


def test_open_while_another_process_holds_it_is_refused(populated):
    """Another process holding the store's lock (simulated: flock is per open file description)."""
    import fcntl

    path, values = populated
    fd = os.open(path / "hiermem.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for how in ("open", "init"):
            with pytest.raises(hm.HierMemError) as ei:
                if how == "open":
                    hm.HierarchicalStore.open(path)
                else:
                    hm.HierarchicalStore(tables(), hm.StoreConfig(path=path, device_rows=DEV, host_rows=HOST,
                                                                  optimizer=hm.Adagrad(lr=0.05), seed=7))
            assert "open in another process" in str(ei.value) and str(path) in str(ei.value)
    finally:
        os.close(fd)
    s = hm.HierarchicalStore.open(path)  # the failed attempts left the path free
    try:
        assert_same(snapshot(s), values)
    finally:
        s.close()


# -- permissions --------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_store_files_are_private(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = tmp_path / "nested" / "store"
        s = make_store(path)
        workload(s, 5, seed=1)
        s.flush()
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
        dmode = stat.S_IMODE(path.stat().st_mode)
        s.close()
    finally:
        os.umask(old)
    assert dmode == 0o700
    assert modes["data.mdb"] == 0o600
    assert modes["lock.mdb"] == 0o600
    for name, mode in modes.items():
        assert mode & 0o077 == 0, f"{name} is accessible by others: {oct(mode)}"


# -- LMDB map growth ----------------------------------------------------------------------------
def test_lmdb_map_grows_from_minimum(tmp_path):
    path = tmp_path / "store"
    n, dim = 20_000, 64
    s = hm.HierarchicalStore([hm.TableSpec("t", None, dim)],
                             hm.StoreConfig(path=path, device_rows=2048, host_rows=8192, map_size=1 << 20))
    vals = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(n) * 1_000_003  # sparse ids of an unbounded table
    for i in range(0, n, 2000):
        s.write("t", ids[i:i + 2000], vals[i:i + 2000])
    s.flush()
    st = s.stats()["_store"]
    assert st["lmdb_map_size"] > 1 << 20
    assert st["lmdb_map_size"] >= n * dim * 4
    assert st["disk_rows"] == n
    s.close()
    s = hm.HierarchicalStore.open(path)
    try:
        got = torch.cat([s.lookup("t", ids[i:i + 5000]) for i in range(0, n, 5000)])
        assert torch.equal(got, vals)
    finally:
        s.close()


# -- disk full --------------------------------------------------------------------------------
class _FailingTxn:
    """A write transaction whose commit fails like LMDB's on a full disk (nothing is written)."""

    def __init__(self, txn, message):
        self.txn, self.message = txn, message

    def __enter__(self):
        return self.txn.__enter__()

    def __exit__(self, *exc):
        self.txn.abort()
        if exc[0] is None:
            raise lmdb.Error(self.message)
        return False


class _FullEnv:
    """Wraps an lmdb.Environment: write transactions (and optionally sync) fail."""

    def __init__(self, env, message="mdb_txn_commit: No space left on device", fail_sync=False):
        self._env, self.message, self.fail_sync, self.commits = env, message, fail_sync, 0

    def begin(self, *a, **kw):
        txn = self._env.begin(*a, **kw)
        if kw.get("write"):
            self.commits += 1
            if not self.fail_sync:
                return _FailingTxn(txn, self.message)
        return txn

    def sync(self, *a):
        if self.fail_sync:
            raise lmdb.Error("mdb_env_sync: No space left on device")
        return self._env.sync(*a)

    def __getattr__(self, name):
        return getattr(self._env, name)


@pytest.fixture(scope="module")
def _flushed_adam_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("adam") / "store"
    s = make_store(path, optimizer=hm.Adam(lr=0.01))
    workload(s, 30, seed=4)
    s.close()
    return path


@pytest.fixture
def dirty_store(_flushed_adam_template):
    """dirty_store(path): a store (Adam) with flushed rows on disk and dirty rows in both tiers;
    every call gives one with the same history (and values)."""
    def make(path):
        copy_store(_flushed_adam_template, path)
        s = hm.HierarchicalStore.open(path, write_combine=0)  # each write-back commits in its op
        workload(s, 12, seed=5)
        st = s.stats()["_store"]
        assert st["device_dirty"] > 0 and st["host_dirty"] > 0
        assert st["device_occupancy"] + st["host_occupancy"] == DEV + HOST
        return s
    return make


def _ops_needing_writes():
    u = universe()
    fresh = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]) * 1_000_000_007
    return {
        "flush": lambda s: s.flush(),
        "close": lambda s: s.close(),
        # 20 rows not resident evict every resident (dirty) row
        "lookup": lambda s: s.lookup("hashed", fresh),
        "update": lambda s: s.update("hashed", fresh, torch.ones(20, 5)),
        "write": lambda s: s.write("bounded", u["bounded"][100:120], torch.zeros(20, 8)),
    }


@pytest.mark.parametrize("opname,fail_sync", [
    ("flush", False), ("close", False), ("lookup", False), ("update", False), ("write", False),
    ("flush", True), ("close", True),  # only flush syncs
], ids=lambda v: {False: "commit", True: "sync"}.get(v, v) if isinstance(v, bool) else v)
def test_injected_enospc_raises_disk_full_and_changes_nothing(tmp_path, dirty_store, opname, fail_sync):
    path = tmp_path / "store"
    s = dirty_store(path)
    twin = dirty_store(tmp_path / "twin")  # the same history; snapshots of s itself would write its dirty rows
    before = snapshot(twin)
    twin.close()
    ops = _ops_needing_writes()
    real = s._disk.env
    s._disk.env = fake = _FullEnv(real, fail_sync=fail_sync)
    try:
        with pytest.raises(hm.DiskFullError) as ei:
            ops[opname](s)
    finally:
        s._disk.env = real
    e = ei.value
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert str(path) in str(e) and "disk full" in str(e)
    assert fake.commits >= 1
    if opname == "close":
        # close() gave up: the store is closed, dirty rows are lost, the flushed ones remain
        assert s.closed
        s = hm.HierarchicalStore.open(path)
        s.close()
        return
    if not fail_sync:
        # nothing changed, and the store works once the disk has room again
        assert_same(snapshot(s), before)
    s.flush()
    assert_same(snapshot(s), before)
    s.close()
    s = hm.HierarchicalStore.open(path)
    try:
        assert_same(snapshot(s), before)
    finally:
        s.close()


@pytest.mark.parametrize("fail_sync", [False, True], ids=["commit", "sync"])
def test_injected_enospc_in_clear(tmp_path, dirty_store, fail_sync):
    """A clear whose commit fails changes nothing (dirty rows included); one whose fsync
    fails has cleared all the same, LMDB and the tiers agreeing (every row reads its
    initial value), and survives a reopen."""
    s = dirty_store(tmp_path / "store")
    twin = dirty_store(tmp_path / "twin")
    before = snapshot(twin)
    twin.clear()
    cleared = snapshot(twin)
    twin.close()
    real = s._disk.env
    s._disk.env = _FullEnv(real, fail_sync=fail_sync)
    try:
        with pytest.raises(hm.DiskFullError):
            s.clear()
    finally:
        s._disk.env = real
    want = cleared if fail_sync else before
    assert_same(snapshot(s), want)
    s.audit()
    s.close()
    s = hm.HierarchicalStore.open(tmp_path / "store")
    try:
        assert_same(snapshot(s), want)
    finally:
        s.close()


def test_injected_enospc_update_does_not_advance_adam_step(tmp_path, dirty_store):
    """A failed update must not count as an optimizer step (Adam's bias correction)."""
    a = dirty_store(tmp_path / "a")
    b = dirty_store(tmp_path / "b")
    fresh = torch.arange(20) * 1_000_000_007 + 3
    real = a._disk.env
    a._disk.env = _FullEnv(real)
    try:
        with pytest.raises(hm.DiskFullError):
            a.update("hashed", fresh, torch.ones(20, 5))
    finally:
        a._disk.env = real
    for s in (a, b):
        s.update("hashed", fresh, torch.ones(20, 5))
    assert_same(snapshot(a), snapshot(b))
    a.close()
    b.close()


def test_other_lmdb_write_errors_are_hiermem_errors(tmp_path, dirty_store):
    s = dirty_store(tmp_path / "store")
    twin = dirty_store(tmp_path / "twin")
    before = snapshot(twin)
    twin.close()
    real = s._disk.env
    s._disk.env = _FullEnv(real, message="mdb_txn_commit: Permission denied")
    try:
        with pytest.raises(hm.HierMemError) as ei:
            s.flush()
    finally:
        s._disk.env = real
    assert not isinstance(ei.value, hm.DiskFullError)
    assert_same(snapshot(s), before)
    s.close()


def _fill_until_failure(s, dim=64, start=500, batch=200):
    """Write fresh rows until the disk fills; returns (error, first id of the failed batch, written)."""
    g = torch.Generator().manual_seed(1)
    written = {}
    i = start
    while i < 200_000:
        v = torch.randn(batch, dim, generator=g)
        try:
            s.write("t", torch.arange(i, i + batch), v)
        except hm.HierMemError as e:
            return e, i, written
        written.update({i + j: v[j] for j in range(batch)})
        i += batch
    raise AssertionError("the 2 MiB tmpfs never filled")


def _tiny_store(mnt):
    path = mnt / "store"
    # each write-back commits in its step: on a 2 MiB disk the rows held for a combined
    # commit (MiBs of them by default) would need more room than the refill frees
    s = hm.HierarchicalStore([hm.TableSpec("t", None, 64)],
                             hm.StoreConfig(path=path, device_rows=256, host_rows=1024, map_size=1 << 20,
                                            write_combine=0))
    flushed = torch.randn(500, 64, generator=torch.Generator().manual_seed(0))
    s.write("t", torch.arange(500), flushed)
    s.flush()
    return s, path, flushed


def test_tmpfs_full_raises_disk_full_error(tiny_fs):
    s, path, _ = _tiny_store(tiny_fs)
    try:
        e, _, _ = _fill_until_failure(s)
        assert isinstance(e, hm.DiskFullError), f"{type(e).__name__}: {e}"
        assert isinstance(e, OSError) and e.errno == errno.ENOSPC
        assert str(path) in str(e)
    finally:
        try:
            s.close()
        except hm.HierMemError:
            pass


def test_tmpfs_full_keeps_flushed_data_and_recovers(tiny_fs):
    filler = tiny_fs / "filler"
    filler.write_bytes(b"\0" * (640 << 10))  # room to free up later
    s, path, flushed = _tiny_store(tiny_fs)
    e, failed_at, written = _fill_until_failure(s)
    assert isinstance(e, hm.HierMemError)
    assert str(path) in str(e)
    # the failed write changed nothing: its rows still hold their initial values
    init_store = hm.HierarchicalStore([hm.TableSpec("t", None, 64)],
                                      hm.StoreConfig(path=tiny_fs.parent / "init", device_rows=256, host_rows=1024))
    init = init_store.lookup("t", torch.arange(failed_at, failed_at + 200))
    init_store.close()
    filler.unlink()
    assert torch.equal(s.lookup("t", torch.arange(failed_at, failed_at + 200)), init)
    assert torch.equal(s.lookup("t", torch.arange(0, 500)), flushed)
    s.flush()  # with room again, everything written before the failure is saved
    s.close()
    s = hm.HierarchicalStore.open(path)
    try:
        assert torch.equal(torch.cat([s.lookup("t", torch.arange(i, i + 250)) for i in range(0, 500, 250)]), flushed)
        ids = sorted(written)
        for i in range(0, len(ids), 1000):
            chunk = torch.tensor(ids[i:i + 1000])
            assert torch.equal(s.lookup("t", chunk), torch.stack([written[j] for j in chunk.tolist()]))
    finally:
        s.close()


def test_tmpfs_full_then_kill_keeps_flushed_data(tiny_fs):
    """Disk full, no room ever comes back, the store is abandoned: the flushed rows survive."""
    s, path, flushed = _tiny_store(tiny_fs)
    _fill_until_failure(s)
    try:
        s.close()
    except hm.HierMemError:
        pass
    assert s.closed
    # reopening only reads
    s = hm.HierarchicalStore.open(path)
    try:
        assert torch.equal(torch.cat([s.lookup("t", torch.arange(i, i + 250)) for i in range(0, 500, 250)]), flushed)
    finally:
        try:
            s.close()  # its flush writes the metadata, which may not fit on the full disk
        except hm.HierMemError:
            pass
    assert s.closed


_HOLD_ENV = r"""
import sys, time, lmdb
env = lmdb.open(sys.argv[1], max_dbs=64, readahead=False)
if sys.argv[2] == "writer":  # dies holding the writers' mutex, as a writer killed inside its commit
    txn = env.begin(write=True)
print("READY", flush=True)
time.sleep(600)
"""


def _stale_lock_record(path: Path, commit: int) -> None:
    """Set LMDB's lock-file record of the last commit to ``commit`` (as a writer killed
    after writing its meta page, before recording it, leaves it)."""
    import struct

    env = lmdb.open(str(path), max_dbs=64, readonly=True)
    last = env.info()["last_txnid"]
    env.close()
    with open(path / "lock.mdb", "r+b") as f:
        head = f.read(128)
        at = [o for o in range(0, 128, 8) if struct.unpack_from("<Q", head, o)[0] == last]
        if len(at) != 1:
            pytest.skip(f"this liblmdb's lock-file layout is not the one this test knows ({at})")
        f.seek(at[0])
        f.write(struct.pack("<Q", commit))


@pytest.mark.parametrize("dead_writer", [True, False], ids=["writer-died-in-commit", "record-behind-no-writer"])
def test_reopen_reads_the_newest_commit_when_the_lock_record_is_behind(tmp_path, dead_writer):
    """A writer killed between writing its commit and recording it in LMDB's lock file,
    while another process still has the environment open: a reopened store reads the
    newest commit, not the one before (LMDB rebuilds the record when the writers' mutex
    is found with a dead owner).  With no dead writer to recover, the open refuses
    with a typed error and changes nothing."""
    from hiermem.tiers.disk import DiskTier

    path = tmp_path / "s"
    d = DiskTier(path, create=True, sync=False, writemap=False)
    d.write([(0, np.arange(4), np.full((4, 4), 1.0, np.float32))], meta={"steps": {"a": 1}})
    d.write([(0, np.arange(4), np.full((4, 4), 2.0, np.float32))], meta={"steps": {"a": 2}})
    last = d.env.info()["last_txnid"]
    d.close()
    procs = [subprocess.Popen([sys.executable, "-c", _HOLD_ENV, str(path), "holder"], stdout=subprocess.PIPE, text=True)]
    if dead_writer:
        procs.append(subprocess.Popen([sys.executable, "-c", _HOLD_ENV, str(path), "writer"], stdout=subprocess.PIPE,
                                      text=True))
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        _stale_lock_record(path, last - 1)
        if dead_writer:
            procs[1].kill()
            procs[1].wait()
            d = DiskTier(path, create=False, writemap=False)  # (a writemap open's preallocation writes)
            try:
                assert d.read_meta()["steps"] == {"a": 2}
                np.testing.assert_array_equal(d.read(0, np.arange(4), 4)[1], np.full((4, 4), 2.0, np.float32))
            finally:
                d.close()
        else:
            with pytest.raises(hm.StoreIOError, match="lock file records commit"):
                DiskTier(path, create=False, writemap=False)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
    d = DiskTier(path, create=False)  # alone now: LMDB rebuilds the record; the newest commit is intact
    try:
        assert d.read_meta()["steps"] == {"a": 2}
        assert d.env.info()["last_txnid"] == last
    finally:
        d.close()


_HOLD_LOCK = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("READY", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize("held", [0.1, 30.0], ids=["released-soon", "held"])
def test_open_waits_briefly_for_a_store_lock_another_process_is_letting_go(tmp_path, held):
    """A process killed while starting a child leaves the store's lock in that child for
    a few milliseconds: an open right then waits for it (``locks.LOCK_WAIT``), and says
    the store is open elsewhere only when the lock stays held."""
    from hiermem.store import locks

    path = tmp_path / "s"
    hm.HierarchicalStore(tables(), hm.StoreConfig(path=path, device_rows=DEV, host_rows=HOST)).close()
    p = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(path / locks.STORE_LOCK), str(held)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "READY"
        t0 = time.monotonic()
        if held < locks.LOCK_WAIT:
            hm.HierarchicalStore.open(path).close()
        else:
            with pytest.raises(hm.HierMemError, match="store is open in another process"):
                hm.HierarchicalStore.open(path)
            assert time.monotonic() - t0 >= locks.LOCK_WAIT
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
