"""The C LMDB I/O process (``hiermem/tiers/lmdb_server.c``) against the Python one.

Both speak one protocol; the same requests on two copies of one store must give the
same replies, the same errors and the same stores.  The C one needs a C compiler and
liblmdb-dev (``bash scripts/install.sh native``): without them these tests skip, except
under ``CI=true``, where ``.ci/run`` installs them and a skip would hide a regression.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.tiers import lmdb_process, native
from hiermem.tiers.lmdb_process import LmdbProcess, LmdbProcessError

from reference import FlatStore

pytestmark = pytest.mark.skipif(not lmdb_process.supported(), reason="I/O processes need Linux")


@pytest.fixture(scope="module")
def built():
    exe, why = native.build()
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the C I/O process does not build: {why}")
        pytest.skip(f"the C I/O process does not build here: {why}")
    return exe


WIDTHS = {0: 4, 1: 16, 2: 1}


def make_env(path, map_size=1 << 24, rows=300, seed=0):
    """A store-shaped environment: ``meta`` and integer-key ``t0..t2`` with random rows."""
    rng = np.random.default_rng(seed)
    env = lmdb.open(str(path), map_size=map_size, max_dbs=8)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(b"store", b"{}", db=meta)
        for t, w in WIDTHS.items():
            db = env.open_db(b"t%d" % t, txn=txn, integerkey=True)
            for i in np.sort(rng.choice(1000, rows, replace=False)).astype(np.uint64):
                txn.put(i.tobytes(), rng.standard_normal(w).astype("<f4").tobytes(), db=db)
    return env


def contents(env) -> dict:
    out = {}
    with env.begin() as txn:
        out["meta"] = txn.get(b"store", db=env.open_db(b"meta", txn=txn))
        for t in WIDTHS:
            out[t] = dict(txn.cursor(db=env.open_db(b"t%d" % t, txn=txn, integerkey=True)))
    return out


def pair(tmp_path, monkeypatch, built, **kw):
    """The same store twice, a C and a Python process on each."""
    envs, procs = [], []
    for name, server in (("c", "native"), ("py", "python")):
        env = make_env(tmp_path / name, **kw)
        monkeypatch.setenv(native.ENV, server)
        p = LmdbProcess(tmp_path / name, env.info()["map_size"], write=True, sync=False)
        assert p.native == (server == "native")
        envs.append(env)
        procs.append(p)
    return envs, procs


def random_groups(rng, write: bool):
    groups = []
    for t in rng.permutation([0, 1, 2, 7])[: rng.integers(1, 5)]:  # table 7 has no database
        n = int(rng.integers(0, 80))
        ids = np.sort(rng.choice(1400, n, replace=False)).astype(np.uint64)  # some past the last key
        w = WIDTHS.get(int(t), 3)
        groups.append((int(t), ids, rng.standard_normal((n, w)).astype(np.float32) if write else w))
    return groups


def test_c_and_python_processes_give_the_same_replies_and_stores(tmp_path, monkeypatch, built):
    (ec, ep), (pc, pp) = pair(tmp_path, monkeypatch, built)
    rng = np.random.default_rng(1)
    for step in range(60):
        if step % 2:
            groups = [g for g in random_groups(rng, write=True) if g[0] in WIDTHS]
            meta = b'{"step": %d}' % step if step % 4 == 1 else None
            pc.write(groups, meta)
            pp.write(groups, meta)
        else:
            groups = random_groups(rng, write=False)
            a, b = pc.read(groups), pp.read(groups)
            assert len(a) == len(b) == len(groups)
            for (fa, ra), (fb, rb) in zip(a, b):
                assert fa.dtype == fb.dtype and np.array_equal(fa, fb)
                assert ra.dtype == rb.dtype and ra.shape == rb.shape and np.array_equal(ra, rb)
    assert contents(ec) == contents(ep)
    assert contents(ec)["meta"] == b'{"step": 57}'
    for p in (pc, pp):
        p.close()


def test_both_refuse_the_same_bad_requests_and_change_nothing(tmp_path, monkeypatch, built):
    (ec, ep), (pc, pp) = pair(tmp_path, monkeypatch, built)
    before = contents(ec)
    assert before == contents(ep)
    bad = [
        lambda p: p.read([(0, np.array([1, 2], np.uint64), 5)]),  # records are 4 floats
        lambda p: p.write([(0, np.array([1, 2000], np.uint64), np.ones((2, 4), np.float32)),
                           (7, np.array([1], np.uint64), np.ones((1, 3), np.float32))], b"x"),  # no t7
        lambda p: p._call(b"Z", b""),
        lambda p: p._call(b"R", b"\x05\x00\x00\x00"),  # five groups announced, none sent
    ]
    for call in bad:
        errs = []
        for p in (pc, pp):
            with pytest.raises(LmdbProcessError) as e:
                call(p)
            assert not e.value.map_full and not e.value.gone
            errs.append(str(e.value))
        if "corrupt" in errs[1] or "no database" in errs[1]:
            assert errs[0] == errs[1]  # the store's messages, word for word
        assert pc.alive and pp.alive  # a refused request leaves the process serving
    assert contents(ec) == before and contents(ep) == before  # nothing of the refused write landed
    got = pc.read([(0, np.array([5], np.uint64), 4)])
    assert got[0][0].shape == (1,)
    for p in (pc, pp):
        p.close()


def test_a_full_map_is_reported_as_such_and_commits_nothing(tmp_path, monkeypatch, built):
    (ec, ep), (pc, pp) = pair(tmp_path, monkeypatch, built, map_size=1 << 20, rows=50)
    before = contents(ec)
    big = [(1, np.arange(5000, 5000 + 40_000, dtype=np.uint64), np.ones((40_000, 16), np.float32))]
    for p in (pc, pp):
        with pytest.raises(LmdbProcessError) as e:
            p.write(big, b"never")
        assert e.value.map_full
    assert contents(ec) == before and contents(ep)["meta"] == before["meta"]
    for p in (pc, pp):  # still serving
        p.write([(0, np.array([1], np.uint64), np.ones((1, 4), np.float32))], None)
        p.close()


def test_a_map_grown_by_another_process_is_adopted(tmp_path, monkeypatch, built):
    (ec, ep), (pc, pp) = pair(tmp_path, monkeypatch, built, map_size=1 << 20, rows=50)
    for env, p in ((ec, pc), (ep, pp)):
        env.set_mapsize(8 << 20)  # this process grows the map and fills past the old size
        with env.begin(write=True) as txn:
            db = env.open_db(b"t1", txn=txn, integerkey=True)
            for i in range(10_000, 10_000 + 12_000):
                txn.put(np.uint64(i).tobytes(), np.zeros(16, "<f4").tobytes(), db=db)
        got = p.read([(1, np.array([10_000, 21_999], np.uint64), 16)])
        assert got[0][0].all()
        p.write([(1, np.array([30_000], np.uint64), np.ones((1, 16), np.float32))], None)
        p.close()
    assert contents(ec) == contents(ep)


def same(s, ref, tables) -> None:
    for t in tables:
        for i in range(0, t.num_rows, 100):
            ids = torch.arange(i, min(i + 100, t.num_rows))
            assert torch.equal(s.lookup(t.name, ids), ref.lookup(t.name, ids))


def test_training_through_the_c_process_equals_the_flat_reference(tmp_path, monkeypatch, built):
    """A disk-backed store whose read-aheads and write-behind commits go through C
    processes: the same values as plain in-memory tables, and the same store on reopen."""
    monkeypatch.setenv(native.ENV, "native")
    monkeypatch.setenv("HIERMEM_DATA_PLANE", "torch")  # bit for bit with the torch-op reference
    tables = [hm.TableSpec("a", 3000, 16), hm.TableSpec("b", 800, 8)]
    cfg = hm.StoreConfig(path=tmp_path / "s", device_rows=64, host_rows=256, optimizer=hm.Adagrad(lr=0.1),
                         seed=4, write_behind=True, io_process=True)
    s = hm.HierarchicalStore(tables, cfg)
    ref = FlatStore(tables, hm.Adagrad(lr=0.1), seed=4)
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        t = i % 2
        ids = torch.randint(0, tables[t].num_rows, (128,), generator=g)
        s.read_ahead(torch.full((128,), t), ids)
        for st in (s, ref):
            emb = st.lookup(tables[t].name, ids)
            st.update(tables[t].name, ids, 0.5 * emb + 0.1)
    assert s._disk.io_process and s._disk.io_failures == 0
    assert s._disk.ahead_hits > 0
    assert len(s._disk.procs.processes()) >= 1 and all(p.native for p in s._disk.procs.processes())
    same(s, ref, tables)
    s.close()
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        same(s, ref, tables)
    finally:
        s.close()


def test_the_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(native.ENV, "python")
    assert native.server() is None
    monkeypatch.setenv(native.ENV, "fast")
    with pytest.raises(ValueError, match="HIERMEM_LMDB_SERVER"):
        native.server()


def test_native_without_a_compiler_is_a_clear_error_and_auto_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path / "cache"])
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(native.ENV, "native")
    with pytest.raises(native.NativeServerError, match="HIERMEM_LMDB_SERVER=native"):
        native.server()
    monkeypatch.setenv(native.ENV, "auto")
    assert native.server() is None  # the Python process then
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_c_process_that_cannot_open_the_store_gives_way_to_python(tmp_path, monkeypatch):
    """A C build that starts but refuses the store (as a liblmdb with another lock format
    would): the Python process serves, and later processes skip the C one."""
    fake = tmp_path / "refuses"
    fake.write_text(f"#!{sys.executable}\nimport sys, struct\nm = b'cannot open: version mismatch'\n"
                    "sys.stdout.buffer.write(struct.pack('<BQ', 2, len(m)) + m)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(native.ENV, "auto")
    monkeypatch.setattr(native, "server", lambda: fake)
    monkeypatch.setattr(lmdb_process, "_native_failed", [])
    make_env(tmp_path / "s")
    p = LmdbProcess(tmp_path / "s", 1 << 24, write=False, sync=False)
    try:
        assert not p.native and p.read([(0, np.array([1], np.uint64), 4)])[0][0].shape == (1,)
        assert lmdb_process._native_failed == ["cannot open: version mismatch"]
    finally:
        p.close()
    assert shutil.which(str(fake))
