"""StoreConfig(write_behind=True): eviction write-backs committed by a writer thread.

Queued rows are read from the queue (never a stale LMDB copy), training equals a store
writing synchronously and a flat reference, a failed background commit is retried and
raised typed by the next writing call with nothing lost, and map growth still works; all
of it with the writer thread committing itself or through its I/O process (which may
also die: the thread then commits in-process, nothing lost)."""

from __future__ import annotations

import errno
import threading
from collections import namedtuple

import lmdb
import numpy as np
import pytest
import torch

import hiermem as hm
import hiermem.tiers.disk as disk_mod
from hiermem.tiers import lmdb_process
from reference import FlatStore

@pytest.fixture(autouse=True)
def _torch_plane(monkeypatch):
    """These tests compare bit for bit with tests/reference.py's torch-op FlatStore: run the
    torch data plane (the compiled one equals it to ~1 ulp, tests/test_dataplane.py)."""
    monkeypatch.setenv("HIERMEM_DATA_PLANE", "torch")


IO = [False, pytest.param(True, marks=pytest.mark.skipif(not lmdb_process.supported(),
                                                          reason="I/O processes need Linux"))]
IO_IDS = ["in-thread", "io-process"]

TABLES = [hm.TableSpec("b", 200, 4), hm.TableSpec("h", None, 3)]
HASHED = torch.tensor([3, 2**33, 2**62 + 5, 2**63 - 1, 17, 123456, 99, 2**40], dtype=torch.int64)


def make(path, wb=True, io=False, **kw):
    cfg = hm.StoreConfig(path=path, device_rows=kw.pop("device_rows", 6), host_rows=kw.pop("host_rows", 12),
                         optimizer=hm.Adagrad(lr=0.1), seed=3, write_behind=wb, io_process=io, **kw)
    return hm.HierarchicalStore(TABLES, cfg)


def batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        name, pool = ("b", torch.arange(200)) if i % 3 else ("h", HASHED)
        ids = pool[torch.randint(0, pool.numel(), (10,), generator=g)]
        yield name, ids, torch.randn(10, TABLES[0 if name == "b" else 1].dim, generator=g)


def step(stores, name, ids, noise):
    """One training step of every store (and reference) in ``stores``: the same lookups."""
    outs = []
    for s in stores:
        emb = s.lookup(name, ids)
        s.update(name, ids, 0.5 * emb + noise)
        outs.append(emb)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def train(stores, steps, seed=0):
    for name, ids, noise in batches(steps, seed):
        step(stores, name, ids, noise)


def snapshot(s):
    return {"b": torch.cat([s.lookup("b", torch.arange(i, i + 10)) for i in range(0, 200, 10)]),
            "h": s.lookup("h", HASHED)}


@pytest.mark.parametrize("io", IO, ids=IO_IDS)
def test_training_equals_synchronous_write_backs_and_the_reference(tmp_path, io):
    wb, sync = make(tmp_path / "wb", io=io), make(tmp_path / "sync", wb=False)
    ref = FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    train([wb, sync, ref], 120)
    assert wb.stats()["_store"]["bytes_host_to_disk"] > 0  # rows really went down (and came back)
    assert wb._disk.io_failures == 0 and len(wb._disk.procs.processes()) == int(io)  # the writer's process, if any
    st = wb.stats()["_store"]
    assert st["disk_io_processes"] == int(io) and st["disk_io_failures"] == 0
    a, b, r = snapshot(wb), snapshot(sync), snapshot(ref)
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], r[k])
    wb.close()
    sync.close()
    s = hm.HierarchicalStore.open(tmp_path / "wb")  # closed = drained and flushed
    try:
        got = snapshot(s)
        assert all(torch.equal(got[k], r[k]) for k in got)
    finally:
        s.close()


@pytest.fixture(params=IO, ids=IO_IDS)
def gated(monkeypatch, request):
    """Hold the writer thread inside its transaction (or before handing it to its I/O
    process) until ``gate`` is set; yields (gate, io_process)."""
    gate = threading.Event()
    real, real_proc = disk_mod.DiskTier._txn_body, disk_mod.DiskTier._proc_write

    def body(self, q):
        inner = real(self, q)

        def run(txn):
            if threading.current_thread().name == "hiermem-lmdb-writer":
                assert gate.wait(30), "test gate never opened"
            inner(txn)
        return run

    def proc_write(proc, q):
        assert gate.wait(30), "test gate never opened"
        real_proc(proc, q)

    monkeypatch.setattr(disk_mod.DiskTier, "_txn_body", body)
    monkeypatch.setattr(disk_mod.DiskTier, "_proc_write", staticmethod(proc_write))
    yield gate, request.param
    gate.set()


def test_the_newest_queued_record_of_a_row_wins(tmp_path, gated):
    """Two queued write-backs of the same rows: a read (one table, or several at once;
    ids unsorted, repeated, some never written) takes each row's newest record."""
    gated, io = gated
    s = make(tmp_path / "s", io=io)
    d, w0, w1 = s._disk, s.widths[0], s.widths[1]
    ids = np.array([5, 9, 1, 150], dtype=np.int64)
    old = np.ones((4, w0), np.float32)
    new = np.arange(4 * w0, dtype=np.float32).reshape(4, w0) + 2
    try:
        d.enqueue([(0, ids, old), (1, np.array([2**40]), np.full((1, w1), 7, np.float32))])
        d.enqueue([(0, ids[1:3], new[1:3])])  # rows 9 and 1 again (the writer holds the first)
        assert d.queued == 7
        q = np.array([9, 5, 9, 150, 7, 1], dtype=np.int64)
        want = np.stack([new[1], old[0], new[1], old[3], np.zeros(w0, np.float32), new[2]])
        hit = [True, True, True, True, False, True]
        order = np.argsort(q, kind="stable")
        for (found, got), o in ((d.read(0, q, w0), slice(None)),
                                (d.read_many([(0, q, w0), (1, np.array([2**40, 3]), w1)])[0], slice(None)),
                                (d.read_many([(1, np.array([3]), w1), (0, q[order], w0)])[1], order)):
            assert found.tolist() == np.array(hit)[o].tolist()
            assert np.array_equal(got, want[o])
        f1, r1 = d.read_many([(0, q[:1], w0), (1, np.array([3, 2**40]), w1)])[1]
        assert f1.tolist() == [False, True] and (r1[1] == 7).all() and (r1[0] == 0).all()
    finally:
        gated.set()
    s.flush()  # committed in order: LMDB ends with the newest records
    found, got = d.read(0, q, w0)
    assert np.array_equal(got, want) and found.tolist() == hit
    s.close()


def test_queued_rows_are_read_from_the_queue(tmp_path, gated):
    gated, io = gated
    s, ref = make(tmp_path / "s", io=io), FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    for name, ids, noise in batches(40, seed=1):
        for st in (s, ref):
            emb = st.lookup(name, ids)
            st.update(name, ids, 0.5 * emb + noise)
        if s._disk.queued:
            break
    assert s._disk.queued > 0  # the writer is held: dirty victims wait in the queue
    # reads take the queued records (LMDB still holds older ones, or none)
    stale = 0
    for ti, ids, rec in s._disk.queue.snapshot()[0].groups:
        spec = TABLES[ti]
        found, got = s._disk.read(ti, ids.astype("int64"), s.widths[ti])
        assert found.all()
        assert torch.equal(torch.from_numpy(got[:, :spec.dim]), ref.lookup(spec.name, torch.from_numpy(ids.astype("int64"))))
        f_lmdb, in_lmdb = s._disk._read(ti, ids.astype("int64"), s.widths[ti])
        stale += int((~f_lmdb).sum()) + int((in_lmdb != got).any(1)[f_lmdb].sum())
    assert stale > 0
    gated.set()
    got, want = snapshot(s), snapshot(ref)
    assert all(torch.equal(got[k], want[k]) for k in got)
    s.flush()
    assert s._disk.queued == 0
    s.close()
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        got = snapshot(s)
        assert all(torch.equal(got[k], want[k]) for k in got)
    finally:
        s.close()


class _FailingWrites:
    """An lmdb.Environment whose write transactions fail (EIO) while ``on``."""

    def __init__(self, env):
        self._env, self.on, self.faults = env, True, 0

    def begin(self, *a, **kw):
        txn = self._env.begin(*a, **kw)
        if kw.get("write") and self.on:
            self.faults += 1
            txn.abort()
            raise lmdb.Error("mdb_txn_commit: Input/output error")
        return txn

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_failed_background_commit_is_retried_raised_typed_and_loses_nothing(tmp_path, monkeypatch):
    s, twin = make(tmp_path / "s"), make(tmp_path / "twin", wb=False)
    train([s, twin], 30)
    st = namedtuple("st", "f_bavail f_frsize")(0, 4096)
    monkeypatch.setattr(disk_mod.os, "statvfs", lambda p: st)  # the disk is full
    real = s._disk.env
    s._disk.env = fake = _FailingWrites(real)
    raised = None
    try:
        for name, ids, noise in batches(60, seed=7):
            try:
                emb = s.lookup(name, ids)
                s.update(name, ids, 0.5 * emb + noise)
            except hm.DiskFullError as e:
                raised = e
                break
            emb = twin.lookup(name, ids)
            twin.update(name, ids, 0.5 * emb + noise)
        assert raised is not None and fake.faults >= 2  # the writer's commit, then the retry
        assert raised.errno == errno.ENOSPC and str(s.path) in str(raised)
        assert s._disk.queued > 0  # the failed batch is still queued
        with pytest.raises(hm.DiskFullError):
            s.flush()
    finally:
        s._disk.env = real
        monkeypatch.undo()
    # the disk has room again: the raising call changed nothing, nothing queued was lost
    got, want = snapshot(s), snapshot(twin)
    assert all(torch.equal(got[k], want[k]) for k in got)
    s.flush()
    assert s._disk.queued == 0
    want = snapshot(twin)
    s.close()
    twin.close()
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        got = snapshot(s)
        assert all(torch.equal(got[k], want[k]) for k in got)
    finally:
        s.close()


@pytest.mark.parametrize("io", IO, ids=IO_IDS)
def test_map_growth_from_the_writer_thread(tmp_path, io):
    """A 1 MiB map fills while the writer commits: the next writing call grows it (the
    I/O process reports the full map, and a new one opens the grown map)."""
    tables = [hm.TableSpec("w", 20_000, 64)]
    cfg = dict(device_rows=64, host_rows=256, optimizer=hm.SGD(lr=0.1), seed=1, map_size=1 << 20,
               io_process=io)
    wb = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "wb", write_behind=True, **cfg))
    ref = FlatStore(tables, hm.SGD(lr=0.1), seed=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        ids = torch.randint(0, 20_000, (256,), generator=g)
        for st in (wb, ref):
            st.update("w", ids, torch.ones(256, 64))
    assert wb._disk.map_size > 1 << 20
    assert wb._disk.io_failures == 0 and wb._disk.io_process == io  # a full map is no failure
    for i in range(0, 20_000, 250):
        ids = torch.arange(i, i + 250)
        assert torch.equal(wb.lookup("w", ids), ref.lookup("w", ids))
    wb.close()


@pytest.mark.skipif(not lmdb_process.supported(), reason="I/O processes need Linux")
def test_a_dying_io_process_loses_nothing_and_is_given_up_after_three(tmp_path):
    """SIGKILL the writer's I/O process again and again while training: each lost commit
    is redone in-process by the next writing call, values equal a synchronous store, and
    after three failures the store stops starting new processes."""
    import os
    import signal

    s, twin = make(tmp_path / "s", io=True), make(tmp_path / "twin", wb=False)
    ref = FlatStore(TABLES, hm.Adagrad(lr=0.1), seed=3)
    killed = 0
    for i, (name, ids, noise) in enumerate(batches(150, seed=5)):
        for st in (s, twin, ref):
            emb = st.lookup(name, ids)
            st.update(name, ids, 0.5 * emb + noise)
        procs = [p for p in s._disk.procs.processes() if p.alive]
        if i % 20 == 10 and procs:
            os.kill(procs[0].proc.pid, signal.SIGKILL)
            procs[0].proc.wait()
            killed += 1
    assert killed >= 3
    assert s._disk.io_failures >= 3 and not s._disk.io_process  # given up: in-thread commits now
    assert s.stats()["_store"]["disk_io_failures"] >= 3
    a, b, r = snapshot(s), snapshot(twin), snapshot(ref)
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(a[k], r[k])
    s.close()
    twin.close()
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        got = snapshot(s)
        assert all(torch.equal(got[k], r[k]) for k in got)
    finally:
        s.close()
