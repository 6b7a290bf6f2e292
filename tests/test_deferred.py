"""The fused update on the store's apply worker (:mod:`hiermem.dataplane.deferred`).

A deferred update runs the same kernel on the same inputs as the synchronous one, so a
store training with it must hold the same rows bit for bit; the store's lock makes every
later call wait for it, so nothing reads a row before its update lands.  These tests
train two stores side by side, deferred and synchronous, and compare them exactly."""

from __future__ import annotations

import math
import time

import pytest
import torch

import hiermem as hm
from hiermem.dataplane import deferred as D

pytestmark = pytest.mark.skipif(not D.available(), reason="needs Linux semaphores and numba's JIT")

T, R, DIM = 3, 80, 16
OPTIMIZERS = {
    "sgd": lambda: hm.SGD(lr=0.05),
    "adagrad": lambda: hm.Adagrad(lr=0.05, eps=1e-8),
    "rowwise_adagrad": lambda: hm.RowWiseAdagrad(lr=0.05, eps=1e-8),
    "adam": lambda: hm.Adam(lr=0.01),
}
TABLES = [hm.TableSpec(f"t{i}", R, DIM) for i in range(T)]


def _store(path, opt, deferred: bool, **kw) -> hm.HierarchicalStore:
    kw = dict(dict(device_rows=60, host_rows=50), **kw)  # 240 rows: some on LMDB
    s = hm.HierarchicalStore(TABLES, hm.StoreConfig(path=path, optimizer=opt, device="cpu", **kw))
    s.data_plane = "compiled"  # (whatever HIERMEM_DATA_PLANE says)
    s.deferred_updates = deferred
    assert s.deferred_updates is deferred
    return s


def _batch(g: torch.Generator, bags: int = 8):
    """``bags`` bags of 1-4 ids per table (table-major); ids from 20 hot rows (shared by
    consecutive batches) and a tail."""
    ts, ks, offs, pos = [], [], [], 0
    for ti in range(T):
        lengths = torch.randint(1, 5, (bags,), generator=g)
        n = int(lengths.sum())
        hot, tail = torch.randint(0, 20, (n,), generator=g), torch.randint(0, R, (n,), generator=g)
        ks.append(torch.where(torch.rand(n, generator=g) < 0.7, hot, tail))
        ts.append(torch.full((n,), ti, dtype=torch.int64))
        offs.append(pos + torch.cumsum(lengths, 0) - lengths)
        pos += n
    return torch.cat(ts), torch.cat(ks), torch.cat(offs)


def _all_rows(s) -> dict[str, torch.Tensor]:
    return {x.name: s.lookup(x.name, torch.arange(R)) for x in TABLES}


def _train(s, steps: int, seed: int = 1, wait_s: float = 0.0, mode: str = "sum", weighted: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.linspace(-1, 1, DIM)
    for _ in range(steps):
        t, k, off = _batch(g)
        psw = torch.rand(k.numel(), generator=g) if weighted else None
        out = s.lookup_bags(t, k, off, mode, psw)
        grad = (out * w).tanh()  # depends on the rows: a stale read changes every later step
        s.update_bags(t, k, off, grad, mode, psw, grad_owned=True)
        if wait_s:
            time.sleep(wait_s)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_deferred_updates_equal_synchronous_ones_bit_for_bit(tmp_path, opt_name):
    a = _store(tmp_path / "a", OPTIMIZERS[opt_name](), deferred=True)
    b = _store(tmp_path / "b", OPTIMIZERS[opt_name](), deferred=False)
    for mode, weighted in (("sum", False), ("mean", False), ("sum", True)):
        _train(a, 12, mode=mode, weighted=weighted)
        _train(b, 12, mode=mode, weighted=weighted)
    assert a._deferred.submitted >= 30 and b._deferred.submitted == 0
    ra, rb = _all_rows(a), _all_rows(b)
    for n in ra:
        assert torch.equal(ra[n], rb[n]), n
    a.audit()
    a.close()
    b.close()


def test_the_module_step_defers_and_stays_exact(tmp_path):
    """The collection's backward hands autograd's gradient over (no copy) and returns
    before the update lands; the next step's lookup sees it."""
    feats = []
    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        lengths = torch.randint(1, 4, (T * 8,), generator=g)
        vals = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
        feats.append(hm.SparseFeatures(tuple(x.name for x in TABLES), vals, lengths))
    final = []
    for deferred in (True, False):
        cfg = hm.StoreConfig(path=tmp_path / f"m{deferred}", optimizer=hm.Adagrad(lr=0.1), device="cpu",
                             device_rows=40, host_rows=40)
        coll = hm.CachedEmbeddingBagCollection(TABLES, cfg)
        coll.store.data_plane = "compiled"
        coll.store.deferred_updates = deferred
        losses = []
        for f in feats:
            out = coll(f)
            loss = (out.sum(1) ** 2).mean()
            loss.backward()
            if deferred:
                assert coll.store._deferred.pending is not None  # returned before the update landed
            losses.append(float(loss))
        final.append((losses, _all_rows(coll.store), coll.store._deferred.submitted))
        coll.store.close()
    (la, ra, na), (lb, rb, nb) = final
    assert na == len(feats) and nb == 0
    assert la == lb
    for n in ra:
        assert torch.equal(ra[n], rb[n]), n


def test_a_gradient_written_after_the_call_does_not_reach_the_rows(tmp_path):
    """Without ``grad_owned`` the store copies the gradient: a caller reusing its buffer
    right after ``update_bags`` changes nothing."""
    a = _store(tmp_path / "a", hm.SGD(lr=0.1), deferred=True)
    b = _store(tmp_path / "b", hm.SGD(lr=0.1), deferred=False)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        t, k, off = _batch(g)
        for s in (a, b):
            out = s.lookup_bags(t, k, off)
            grad = torch.ones_like(out)
            s.update_bags(t, k, off, grad)
            grad.fill_(1e6)  # the buffer reused at once
    assert a._deferred.submitted == 6
    ra, rb = _all_rows(a), _all_rows(b)
    for n in ra:
        assert torch.equal(ra[n], rb[n]), n
        assert float(ra[n].abs().max()) < 100
    a.close()
    b.close()


def test_a_nan_gradient_raises_and_changes_nothing_behind_a_deferred_update(tmp_path):
    a = _store(tmp_path / "a", hm.Adam(lr=0.01), deferred=True)
    g = torch.Generator().manual_seed(3)
    _train(a, 3)
    t, k, off = _batch(g)
    out = a.lookup_bags(t, k, off)
    a.update_bags(t, k, off, torch.ones_like(out), grad_owned=True)  # in flight now
    assert a._deferred.pending is not None
    steps = [a.table_step(x.name) for x in TABLES]
    before = _all_rows(a)  # (waits for it)
    out = a.lookup_bags(t, k, off)
    bad = torch.ones_like(out)
    bad[1, 3] = math.nan
    with pytest.raises(hm.NonFiniteGradientError):
        a.update_bags(t, k, off, bad, grad_owned=True)
    assert a._deferred.pending is None
    after = _all_rows(a)
    for n in before:
        assert torch.equal(before[n], after[n]), n
    assert [a.table_step(x.name) for x in TABLES] == steps
    a.close()


def test_the_store_lock_waits_for_the_update_and_close_stops_the_worker(tmp_path):
    a = _store(tmp_path / "a", hm.SGD(lr=0.1), deferred=True)
    g = torch.Generator().manual_seed(5)
    t, k, off = _batch(g)
    out = a.lookup_bags(t, k, off)
    a.update_bags(t, k, off, torch.ones_like(out), grad_owned=True)
    d = a._deferred
    assert d.pending is not None and d.held is not None
    with a.lock:
        assert d.pending is None and d.held is None  # entering the lock waited for it
    a.update_bags(t, k, off, torch.ones_like(out), grad_owned=True)
    workers = list(d._workers.values())
    assert workers and all(w.thread.is_alive() for w in workers)
    a.update_bags(t, k, off, torch.ones_like(out), grad_owned=True)
    a.close()  # waits for the last update, flushes, stops the worker
    assert not any(w.thread.is_alive() for w in workers)
    b = _store(tmp_path / "a", hm.SGD(lr=0.1), deferred=False)  # reopened: the last update is durable
    got = _all_rows(b)
    ref = _store(tmp_path / "ref", hm.SGD(lr=0.1), deferred=False)
    for _ in range(3):
        o = ref.lookup_bags(t, k, off)
        ref.update_bags(t, k, off, torch.ones_like(o))
    exp = _all_rows(ref)
    for n in got:
        assert torch.equal(got[n], exp[n]), n
    b.close()
    ref.close()


def test_every_job_is_taken_once_whether_the_worker_spins_or_sleeps(tmp_path):
    """Jobs at a steady pace (the worker learns it and spins for them) and at random
    gaps (it sleeps on the semaphore): each is taken exactly once, and every result is
    the synchronous one."""
    a = _store(tmp_path / "a", hm.SGD(lr=0.05), deferred=True)
    b = _store(tmp_path / "b", hm.SGD(lr=0.05), deferred=False)
    g = torch.Generator().manual_seed(7)
    gaps = [0.003] * 30 + [float(x) for x in torch.rand(20, generator=g) * 0.01]
    for gap in gaps:
        t, k, off = _batch(g)
        for s in (a, b):
            out = s.lookup_bags(t, k, off)
            s.update_bags(t, k, off, (out * 0.5).sin(), grad_owned=True)
        time.sleep(gap)
    w = a._deferred._workers[0]
    a.lookup(TABLES[0].name, torch.arange(1))  # (waits for the last one)
    assert int(w.box[D._SPUN]) + int(w.box[D._SLEPT]) == len(gaps) == a._deferred.submitted
    ra, rb = _all_rows(a), _all_rows(b)
    for n in ra:
        assert torch.equal(ra[n], rb[n]), n
    a.close()
    b.close()


def test_deferred_updates_off_or_unsupported_run_synchronously(tmp_path):
    a = _store(tmp_path / "a", hm.SGD(lr=0.05), deferred=False)
    _train(a, 3)
    assert a._deferred.submitted == 0 and not a._deferred._workers
    a.deferred_updates = True
    a.data_plane = "torch"  # the torch plane's updates are torch ops on this thread
    _train(a, 2)
    assert a._deferred.submitted == 0
    a.close()
