"""The disk tier's read-ahead cache: records read outside the store's lock for an upcoming
batch must never be served stale (a write in the meantime, even one racing the read),
whether the read-ahead thread reads LMDB itself or through its I/O process."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.tiers import disk as disk_mod
from hiermem.tiers import lmdb_process
from hiermem.tiers.disk import DiskTier

IO = [False, pytest.param(True, marks=pytest.mark.skipif(not lmdb_process.supported(),
                                                          reason="I/O processes need Linux"))]

W = 4


def _rec(ids, v):
    return np.full((len(ids), W), v, dtype=np.float32) + np.asarray(ids, dtype=np.float32)[:, None]


@pytest.fixture(params=IO, ids=["in-thread", "io-process"])
def disk(tmp_path, request):
    d = DiskTier(tmp_path / "lmdb", create=True, sync=False, io_process=request.param)
    d.write([(0, np.arange(100), _rec(np.arange(100), 0.0))])
    yield d
    if request.param:  # the read-aheads really went through a process, which never failed
        assert d.io_failures == 0 and d.io_process
    d.close()


def test_read_ahead_serves_reads_and_counts(disk):
    ids = np.array([5, 7, 99, 150])  # 150 was never written
    kept = disk.read_ahead([(0, ids, W)], disk.begin_read_ahead())
    assert kept == 4
    assert len(disk.procs.processes()) == int(disk.io_process)
    found, rec = disk.read(0, np.array([150, 7, 5, 99, 3]), W)
    assert found.tolist() == [False, True, True, True, True]
    np.testing.assert_array_equal(rec[1:], _rec([7, 5, 99, 3], 0.0))
    assert disk.ahead_hits == 4  # 3 came from LMDB


@pytest.mark.parametrize("where", ["main", "thread"])
def test_read_many_takes_the_cache_then_one_lmdb_read_for_every_table(disk, where):
    """A placement's batched read with read-ahead records cached: each table's cached
    keys from the cache, the rest of every table in one LMDB read (one I/O round trip
    off the main thread); unsorted, repeated and never-written ids, a table never
    written, and write-backs newer than LMDB all as :meth:`read` gives them."""
    disk.write([(1, np.arange(50), _rec(np.arange(50), 2.0))])
    disk.read_ahead([(0, np.array([5, 7, 99]), W), (1, np.array([3]), W)], disk.begin_read_ahead())
    groups = [(0, np.array([150, 7, 5, 99, 7, 3, 42]), W), (1, np.array([49, 3, 60, 1]), W),
              (2, np.array([4, 2]), W), (0, np.array([], dtype=np.int64), W)]
    calls = []
    if disk.io_process:
        real = disk._proc_read
        disk._proc_read = lambda asked: calls.append([len(k) for _, k, _ in asked]) or real(asked)
    got = {}
    if where == "main":
        got["r"] = disk.read_many(groups)
    else:
        t = threading.Thread(target=lambda: got.update(r=disk.read_many(groups)))
        t.start()
        t.join()
    r = got["r"]
    assert r[0][0].tolist() == [False, True, True, True, True, True, True]
    np.testing.assert_array_equal(r[0][1][1:], _rec([7, 5, 99, 7, 3, 42], 0.0))
    assert not r[0][1][0].any()
    assert r[1][0].tolist() == [True, True, False, True]
    np.testing.assert_array_equal(r[1][1][[0, 1, 3]], _rec([49, 3, 1], 2.0))
    assert not r[2][0].any() and r[3][0].shape == (0,) and r[3][1].shape == (0, W)
    assert disk.ahead_hits == 4  # 5, 7, 99 of table 0 and 3 of table 1
    if disk.io_process and where == "thread":
        assert calls == [[3, 3]]  # table 0's 3, 42, 150 and table 1's 1, 49, 60: one request
    else:
        assert calls == []


def test_a_write_after_the_read_ahead_drops_the_cached_copy(disk):
    disk.read_ahead([(0, np.array([1, 2, 3]), W)], disk.begin_read_ahead())
    disk.write([(0, np.array([2, 150]), _rec([2, 150], 1.0))])
    found, rec = disk.read(0, np.array([1, 2, 3]), W)
    np.testing.assert_array_equal(rec, np.concatenate([_rec([1], 0.0), _rec([2], 1.0), _rec([3], 0.0)]))
    assert disk.ahead_hits == 2


def test_a_write_racing_the_read_ahead_is_not_served_stale(disk, monkeypatch):
    """The read-ahead's LMDB snapshot predates a write that commits before its records
    enter the cache: the keys written meanwhile are dropped, not served."""
    cls, name = (lmdb_process.LmdbProcess, "read") if disk.io_process else (disk_mod.DiskTier, "parse_records")
    real = getattr(cls, name)
    fired = []

    def read_then_write(self, *a):
        r = real(self, *a)
        if not fired and threading.current_thread().name == "ahead":
            fired.append(1)  # another thread commits new values while this read is open
            t = threading.Thread(target=lambda: disk.write([(0, np.array([10, 11]), _rec([10, 11], 5.0))]))
            t.start()
            t.join()
        return r

    monkeypatch.setattr(cls, name, read_then_write)
    token = disk.begin_read_ahead()
    out = []
    th = threading.Thread(target=lambda: out.append(disk.read_ahead([(0, np.array([10, 11, 12]), W)], token)),
                          name="ahead")
    th.start()
    th.join()
    assert fired and out == [1]  # only id 12 kept
    found, rec = disk.read(0, np.array([10, 11, 12]), W)
    np.testing.assert_array_equal(rec, np.concatenate([_rec([10, 11], 5.0), _rec([12], 0.0)]))


def test_clear_discards_cached_and_in_flight_read_aheads(disk):
    disk.read_ahead([(0, np.array([1, 2]), W)], disk.begin_read_ahead())
    token = disk.begin_read_ahead()
    disk.clear_rows()
    assert disk.read_ahead([(0, np.array([3]), W)], token) == 0
    found, _ = disk.read(0, np.array([1, 2, 3]), W)
    assert not found.any()


@pytest.mark.parametrize("io_process", IO, ids=["in-thread", "io-process"])
def test_store_read_ahead_then_training_equals_plain_lookups(tmp_path, io_process):
    """Rows evicted dirty, read ahead, then looked up and updated: same values as a store
    that never read ahead; the cache served the disk reads."""
    tables = [hm.TableSpec("a", 500, 4), hm.TableSpec("b", 300, 4)]
    stores = [hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / n, device_rows=16, host_rows=32,
                                                          optimizer=hm.Adagrad(lr=0.1), io_process=io_process))
              for n in ("ahead", "plain")]
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        t = torch.randint(0, 2, (40,), generator=g)
        k = torch.randint(0, 300, (40,), generator=g)
        offsets = torch.arange(0, 40, 4)
        grad = torch.randn(10, 4, generator=g)
        outs = []
        for i, s in enumerate(stores):
            if i == 0:
                s.read_ahead(t, k)
            outs.append(s.lookup_bags(t, k, offsets))
            s.update_bags(t, k, offsets, grad)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for name in ("a", "b"):
        ia, ra = stores[0].export(name)
        ib, rb = stores[1].export(name)
        oa, ob = torch.argsort(ia), torch.argsort(ib)
        assert torch.equal(ia[oa], ib[ob]) and torch.equal(ra[oa], rb[ob])
    st = stores[0].stats()["_store"]
    assert st["disk_read_ahead_hits"] > 100 and st["disk_read_ahead_rows"] >= st["disk_read_ahead_hits"]
    assert stores[0]._disk.io_failures == 0 and len(stores[0]._disk.procs.processes()) == int(io_process)
    for s in stores:
        s.close()


def test_lookup_reuses_its_prefetch_only_for_the_same_ids(tmp_path):
    """A lookup given a ticket takes the prefetch's dedup and device slots when its tensors
    hold what the prefetch was given (even other tensors, other int dtypes); a ticket of
    other ids is refused with a typed error."""
    tables = [hm.TableSpec("a", 1000, 4)]
    s = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device_rows=64, host_rows=64))
    ref = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "r", device_rows=64, host_rows=64))
    t = torch.zeros(12, dtype=torch.int64)
    ids = torch.tensor([5, 9, 5, 700, 3, 9, 11, 12, 13, 5, 600, 601])
    offsets = torch.tensor([0, 4, 8])
    ticket = s.prefetch(t, ids)
    assert ticket.pinned and ticket.on_device and ticket.slots is not None
    same = s.lookup_bags(t.clone(), ids.clone(), offsets, ticket=ticket)  # equal content, new tensors
    torch.testing.assert_close(same, ref.lookup_bags(t, ids, offsets), rtol=0, atol=0)
    ref.lookup_bags(t, ids, offsets)
    with pytest.raises(hm.InvalidArgumentError, match="other ids"):
        s.lookup_bags(t, ids + 100, offsets, ticket=ticket)  # not what was prefetched: refused, nothing changed
    torch.testing.assert_close(s.lookup_bags(t.int(), ids.int(), offsets), ref.lookup_bags(t, ids, offsets),
                               rtol=0, atol=0)
    s.release(ticket)
    assert int(s._dev.pins.sum()) == 0
    s.audit()
    for x in (s, ref):
        x.close()


def test_pipeline_threads_leave_the_callers_torch_threads_alone():
    """The pipeline's threads run their small ops single-threaded (with OpenMP, per
    thread), and neither the caller's count nor that of threads started later changes."""
    from hiermem.nn import pipeline

    before = torch.get_num_threads()
    w = pipeline._Worker(torch.device("cpu"))
    seen = []
    try:
        w.submit(lambda: seen.append(torch.get_num_threads()))
        w.wait_idle(30)
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
    finally:
        w.close()
    assert torch.get_num_threads() == before and later == [before]
    if pipeline._per_thread_intra_op():
        assert seen == [1]


@pytest.mark.skipif(not lmdb_process.supported(), reason="I/O processes need Linux")
def test_a_background_threads_placement_read_goes_through_its_io_process(tmp_path, monkeypatch):
    """A placement's LMDB read off the main thread (a prefetch thread's) is done by that
    thread's I/O process, so the training thread keeps the GIL; the main thread reads
    in-thread.  Same records either way, duplicates and unsorted ids included."""
    d = DiskTier(tmp_path / "lmdb", create=True, sync=False, io_process=True)
    d.write([(0, np.arange(100), _rec(np.arange(100), 0.0)), (1, np.arange(50), _rec(np.arange(50), 2.0))])
    in_thread = []
    real = d.snapshot_read
    monkeypatch.setattr(d, "snapshot_read", lambda fn, *a, **k: in_thread.append(1) or real(fn, *a, **k))
    ids = np.array([150, 7, 5, 99, 7, 3])
    want_f = np.array([False, True, True, True, True, True])

    def reads():
        f, r = d.read(0, ids, W)
        many = d.read_many([(0, ids, W), (1, np.array([49, 60, 1]), W)])
        return f, r, many

    got = {}
    t = threading.Thread(target=lambda: got.update(bg=reads()))
    t.start()
    t.join()
    assert in_thread == [] and len(d.procs.processes()) == 1  # the thread's process read
    got["main"] = reads()
    assert len(in_thread) == 2  # the main thread: in-thread reads
    for f, r, many in got.values():
        assert f.tolist() == want_f.tolist()
        np.testing.assert_array_equal(r[1:], _rec([7, 5, 99, 7, 3], 0.0))
        assert many[0][0].tolist() == want_f.tolist() and np.array_equal(many[0][1], r)
        assert many[1][0].tolist() == [True, False, True]
        np.testing.assert_array_equal(many[1][1][[0, 2]], _rec([49, 1], 2.0))
    assert d.io_failures == 0
    d.close()


def test_a_prefetch_waits_for_its_batchs_read_ahead(tmp_path, monkeypatch):
    """A prefetch places its batch's disk rows from that batch's read-ahead, waiting for
    it when it is late, instead of reading them from LMDB itself under the store's lock
    (which the training thread's lookup would wait for); training still equals a store
    without threads."""
    tables = [hm.TableSpec("a", 3000, 8)]
    base = tmp_path / "base"
    s = hm.HierarchicalStore(tables, hm.StoreConfig(path=base, device_rows=64, host_rows=64))
    for i in range(0, 3000, 100):  # every row written to LMDB
        ids = torch.arange(i, i + 100)
        s.lookup_bags(torch.zeros(100, dtype=torch.int64), ids, torch.arange(0, 100, 10))
        s.update_bags(torch.zeros(100, dtype=torch.int64), ids, torch.arange(0, 100, 10), torch.ones(10, 8))
    s.close()
    g = torch.Generator().manual_seed(3)
    batches = [hm.SparseFeatures.from_dict({"a": (torch.randint(0, 3000, (64,), generator=g), torch.full((16,), 4))})
               for _ in range(12)]
    outs = {}
    for name, threads in (("threads", True), ("inline", False)):
        p = tmp_path / name
        shutil.copytree(base, p)
        st = hm.HierarchicalStore.open(p, device_rows=256, host_rows=4096)  # no eviction to LMDB
        coll = hm.CachedEmbeddingBagCollection(tables, store=st)
        if threads:
            real = st.read_ahead

            def slow(*a, **k):  # a read-ahead that is always late for its prefetch
                threading.Event().wait(0.05)
                return real(*a, **k)
            monkeypatch.setattr(st, "read_ahead", slow)
        lmdb_rows = []
        real_proc = st._disk._proc_read
        monkeypatch.setattr(st._disk, "_proc_read", lambda asked: (
            lmdb_rows.append((threading.current_thread().name, sum(len(u) for _, u, _ in asked))) or real_proc(asked)))
        res = []
        with hm.PrefetchPipeline(iter(batches), coll, depth=1, background=threads) as pipe:
            for f in pipe:
                out = coll(f)
                res.append(out.detach().clone())
                out.sum().backward()
        outs[name] = res
        if threads:
            by = {}
            for th, n in lmdb_rows:
                by[th] = by.get(th, 0) + n
            assert by.get("hiermem-read-ahead", 0) > 500  # the disk rows were read ahead ...
            assert by.get("hiermem-prefetch", 0) == 0  # ... and the prefetch read none of them itself
            assert st.stats()["_store"]["disk_read_ahead_hits"] > 500
        st.close()
    for a, b in zip(outs["threads"], outs["inline"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
