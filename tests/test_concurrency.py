"""Concurrency stress: a training loop, a metrics scraper (HTTP, hm.serve_metrics), a thread
calling flush() and a thread doing lookups/where/stats share one store for a bounded time.

No deadlock (every thread must finish before a watchdog deadline; on timeout all stacks
are dumped), no exception in any thread, and no corruption: the trainer checks every
lookup against a flat reference as it goes, and the final and reopened stores equal it.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import urllib.request

import torch
from prometheus_client import CollectorRegistry

import hiermem as hm
from reference import FlatStore

TABLES = [hm.TableSpec("u", 400, 8), hm.TableSpec("v", None, 4)]
V_POOL = torch.tensor([(i * 0x9E3779B97F4A7C15) % 2**63 for i in range(150)], dtype=torch.int64)
WATCHDOG_S = 120.0
STEPS = 300


def _ids(g, table):
    if table == "u":
        return (torch.rand(24, generator=g) ** 2 * 400).long()
    return V_POOL[(torch.rand(12, generator=g) ** 2 * 150).long()]


class Worker(threading.Thread):
    """A daemon thread running ``fn(stop)`` in a loop until ``stop`` is set, counting
    iterations and keeping the first exception."""

    def __init__(self, name, fn, stop):
        super().__init__(name=name, daemon=True)
        self.fn, self.stop, self.count, self.error = fn, stop, 0, None

    def run(self):
        try:
            while not self.stop.is_set():
                self.fn()
                self.count += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def run_watched(trainer: threading.Thread, workers: list, stop: threading.Event) -> None:
    """Start the workers and the trainer; when the trainer is done (or the watchdog
    deadline passes) stop the workers.  Any thread still alive then is a deadlock: every
    stack is dumped and the test fails."""
    faulthandler.dump_traceback_later(WATCHDOG_S + 30, exit=False, file=sys.stderr)
    try:
        for w in workers:
            w.start()
        trainer.start()
        trainer.join(WATCHDOG_S)
        stop.set()
        for w in workers:
            w.join(30)
        alive = [t.name for t in [trainer, *workers] if t.is_alive()]
        if alive:
            faulthandler.dump_traceback(file=sys.stderr)
        assert not alive, f"deadlock: {alive} still running after the watchdog deadline"
    finally:
        stop.set()
        faulthandler.cancel_dump_traceback_later()


def test_training_scrapes_flushes_and_lookups_share_a_store(tmp_path):
    opt = hm.Adagrad(lr=0.1)
    store = hm.HierarchicalStore(TABLES, hm.StoreConfig(path=tmp_path / "s", device_rows=16, host_rows=48,
                                                        optimizer=opt, seed=4))
    ref = FlatStore(TABLES, opt, seed=4)
    stores = hm.MetricsRegistry()
    stores.add(store, "stress")
    server, _ = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    stop = threading.Event()
    rg = torch.Generator().manual_seed(99)
    rlock = threading.Lock()  # the reader's generator only

    def scrape():
        with urllib.request.urlopen(url, timeout=30) as r:
            assert b'hiermem_lookups_total{store="stress"' in r.read()

    def flush():
        store.flush()
        time.sleep(0.001)

    def read():
        with rlock:
            table = "u" if torch.rand(1, generator=rg) < 0.5 else "v"
            ids = _ids(rg, table)
        out = store.lookup(table, ids)  # moves rows between tiers, never changes a value
        assert out.shape == (ids.numel(), TABLES[0].dim if table == "u" else 4)
        assert bool(torch.isfinite(out).all())
        assert store.where(table, ids).numel() == ids.numel()
        assert store.stats()["_store"]["device_occupancy"] <= 16

    workers = [Worker("scrape", scrape, stop), Worker("flush", flush, stop), Worker("read", read, stop)]
    trainer_error, steps = [], [0]

    def train():
        g = torch.Generator().manual_seed(5)
        try:
            for step in range(STEPS):
                table = "u" if step % 3 else "v"
                ids = _ids(g, table)
                emb = store.lookup(table, ids)
                assert torch.allclose(emb, ref.lookup(table, ids), atol=1e-6), f"step {step}: a row was corrupted"
                grads = 0.5 * emb + torch.randn(emb.shape, generator=g)
                store.update(table, ids, grads)
                ref.update(table, ids, grads)
                if step % 25 == 24:
                    v = torch.randn(3, 8, generator=g)
                    store.write("u", torch.tensor([1, 2, 3]), v)
                    ref.write("u", torch.tensor([1, 2, 3]), v)
                steps[0] += 1
        except BaseException as e:  # noqa: BLE001
            trainer_error.append(e)

    try:
        run_watched(threading.Thread(target=train, name="train", daemon=True), workers, stop)
    finally:
        server.shutdown()
    assert not trainer_error, trainer_error
    for w in workers:
        assert w.error is None, f"{w.name}: {w.error!r}"
    assert steps[0] == STEPS
    # the other threads really ran alongside the training
    assert all(w.count >= 5 for w in workers), {w.name: w.count for w in workers}
    st = store.stats()["_store"]
    assert st["flushes"] >= workers[1].count and st["bytes_host_to_disk"] > 0

    def compare(s):
        for table, pool in (("u", torch.arange(400)), ("v", V_POOL)):
            for i in range(0, pool.numel(), 60):
                ids = pool[i:i + 60]
                assert torch.allclose(s.lookup(table, ids), ref.lookup(table, ids), atol=1e-6), table
    compare(store)
    store.audit()
    store.close()
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        compare(s)
    finally:
        s.close()


def test_close_under_load_is_clean_and_loses_nothing(tmp_path):
    """Two trainers (one table each), a scraper and a flusher run while the main thread
    closes the store: every thread ends with success or StoreClosedError (nothing else, no
    deadlock), and after reopening each table equals its trainer's reference as of the
    trainer's last completed update (close flushed it)."""
    opt = hm.Adagrad(lr=0.1)
    store = hm.HierarchicalStore(TABLES, hm.StoreConfig(path=tmp_path / "s", device_rows=16, host_rows=48,
                                                        optimizer=opt, seed=4))
    stores = hm.MetricsRegistry()
    stores.add(store, "closing")
    server, _ = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    refs = {t: FlatStore(TABLES, opt, seed=4) for t in ("u", "v")}
    done = {t: 0 for t in refs}
    errors: list[BaseException] = []

    def trainer(table):
        g = torch.Generator().manual_seed({"u": 1, "v": 2}[table])
        ref = refs[table]
        try:
            while True:
                ids = _ids(g, table)
                emb = store.lookup(table, ids)
                assert torch.allclose(emb, ref.lookup(table, ids), atol=1e-6)
                grads = 0.5 * emb + torch.randn(emb.shape, generator=g)
                store.update(table, ids, grads)
                ref.update(table, ids, grads)
                done[table] += 1
        except hm.StoreClosedError:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def side(fn):
        try:
            while not store.closed:
                fn()
        except hm.StoreClosedError:
            pass
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def scrape():
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()

    threads = [threading.Thread(target=trainer, args=(t,), daemon=True) for t in refs]
    threads += [threading.Thread(target=side, args=(fn,), daemon=True) for fn in (scrape, store.flush)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + WATCHDOG_S
        while min(done.values()) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        store.close()
        for t in threads:
            t.join(30)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            faulthandler.dump_traceback(file=sys.stderr)
        assert not alive, f"deadlock: {alive}"
    finally:
        server.shutdown()
    assert not errors, errors
    assert min(done.values()) >= 40
    s = hm.HierarchicalStore.open(tmp_path / "s")
    try:
        for table, pool in (("u", torch.arange(400)), ("v", V_POOL)):
            for i in range(0, pool.numel(), 60):
                ids = pool[i:i + 60]
                assert torch.allclose(s.lookup(table, ids), refs[table].lookup(table, ids), atol=1e-6), table
    finally:
        s.close()


def _feature_batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (2 * 8,), generator=g)  # 2 features x 8 samples
        na, nb = lengths.view(2, 8).sum(1).tolist()
        vals = torch.cat(((torch.rand(na, generator=g) ** 2 * 400).long(),
                          V_POOL[(torch.rand(nb, generator=g) ** 2 * 150).long()]))
        out.append(hm.SparseFeatures(("u", "v"), vals, lengths))
    return out


def test_prefetch_thread_training_scrapes_flushes_checkpoints_and_lookups(tmp_path):
    """The PrefetchPipeline's thread (depth 3) prefetches while the module trains, and a
    scraper, a flusher, a checkpointer and a lookup thread share the store: no deadlock,
    no error, every pin released, the rows equal a plain run's, every checkpoint restores."""
    data = _feature_batches(120, seed=3)

    def module(path):
        return hm.CachedEmbeddingBagCollection(TABLES, hm.StoreConfig(path=path, device_rows=200, host_rows=400,
                                                                      optimizer=hm.Adagrad(lr=0.1), seed=4))
    plain = module(tmp_path / "plain")
    for f in data:
        plain(f).square().sum().backward()
    m = module(tmp_path / "s")
    store = m.store
    stores = hm.MetricsRegistry()
    stores.add(store, "pf")
    server, _ = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    stop = threading.Event()
    cks = []

    def scrape():
        with urllib.request.urlopen(url, timeout=30) as r:
            assert b"hiermem_prefetch" in r.read()

    def checkpoint():
        cks.append(store.checkpoint(tmp_path / "ck" / str(len(cks))))
        time.sleep(0.02)

    def read():
        ids = torch.randint(0, 400, (4,))
        assert store.lookup("u", ids).shape == (4, 8)

    workers = [Worker(n, fn, stop) for n, fn in (("scrape", scrape), ("flush", store.flush),
                                                  ("checkpoint", checkpoint), ("read", read))]
    errors, stats = [], {}

    def train():
        try:
            with hm.PrefetchPipeline(data, m, depth=3, timeout=60) as pipe:
                for f in pipe:
                    m(f).square().sum().backward()
                stats.update(pipe.stats())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    try:
        run_watched(threading.Thread(target=train, name="train", daemon=True), workers, stop)
    finally:
        server.shutdown()
    assert not errors, errors
    for w in workers:
        assert w.error is None, f"{w.name}: {w.error!r}"
    assert all(w.count >= 3 for w in workers), {w.name: w.count for w in workers}
    assert stats["steps"] == len(data) and stats["prefetched_batches"] > 0 and stats["prefetch_hits"] > 0, stats
    assert int(store._dev.pins.sum()) == 0 and int(store._host.pins.sum()) == 0  # every pin released
    store.audit()

    def rows(s):
        return [torch.cat([s.lookup(t, pool[i:i + 100]) for i in range(0, pool.numel(), 100)])
                for t, pool in (("u", torch.arange(400)), ("v", V_POOL))]
    want = rows(plain.store)
    torch.testing.assert_close(rows(store), want, rtol=1e-5, atol=1e-5)
    plain.store.close()
    store.close()
    for i, ck in enumerate(cks[:: max(1, len(cks) // 4)]):  # a few of the concurrent checkpoints restore
        r = hm.HierarchicalStore.restore(ck, tmp_path / f"restored{i}")
        try:
            r.audit()
            assert all(bool(torch.isfinite(x).all()) for x in rows(r))
        finally:
            r.close()


def test_background_jobs_wait_while_the_training_thread_is_inside_and_never_deadlock():
    """The pipeline's gate: a background job submitted while the training thread is
    inside hiermem (gate closed) does not start until it leaves, or until it waits for
    that job (``wait_idle`` opens the gate meanwhile: no deadlock); a job under way when
    the gate closes goes on."""
    from hiermem.nn.pipeline import _Gate, _Worker

    gate = _Gate()
    w = _Worker(torch.device("cpu"), name="hiermem-test", gate=gate)
    ran, started, release = [], threading.Event(), threading.Event()
    try:
        assert gate.close() and not gate.close()  # a nested entry does not own it
        w.submit(lambda: ran.append("a"))
        time.sleep(0.1)
        assert ran == []  # held at the gate
        w.wait_idle(5)  # the training thread waits for it: the gate opens, then closes again
        assert ran == ["a"] and gate.closed_by_me()
        w.submit(lambda: ran.append("b"))
        time.sleep(0.05)
        assert ran == ["a"]
        gate.open()
        w.wait_idle(5)
        assert ran == ["a", "b"]

        def long_job():  # under way when the gate closes: it is not stopped
            started.set()
            release.wait(5)
            ran.append("c")
        w.submit(long_job)
        assert started.wait(5)
        assert gate.close()
        release.set()
        w.wait_idle(5)
        assert ran[-1] == "c" and gate.closed_by_me()
        gate.open()
    finally:
        gate.open()
        w.close()


def test_a_parked_gate_holds_jobs_until_the_forward_leaves_and_any_other_entry_opens_it():
    """Taking a batch parks the gate: the jobs it submitted start when that batch's
    forward leaves (the forward takes the gate over), or when anyone else enters first
    (a batch taken and never looked up), or while the training thread waits for them;
    a wait leaves it parked as it found it."""
    from hiermem.nn.pipeline import _Gate, _Worker

    gate = _Gate()
    w = _Worker(torch.device("cpu"), name="hiermem-test", gate=gate)
    ran = []
    try:
        assert gate.close()
        w.submit(lambda: ran.append("a"))
        gate.park()  # __next__ leaves
        time.sleep(0.05)
        assert ran == [] and gate.parked
        assert gate.close(take_over=True)  # the forward: owns it now, still closed
        assert not gate.parked and gate.closed_by_me()
        time.sleep(0.05)
        assert ran == []
        gate.open()  # the forward leaves
        w.wait_idle(5)
        assert ran == ["a"]

        assert gate.close()
        w.submit(lambda: ran.append("b"))
        gate.park()
        assert gate.close()  # not the forward (say, the next __next__): it opens first
        w.wait_idle(5)
        assert ran == ["a", "b"] and gate.closed_by_me() and not gate.parked
        w.submit(lambda: ran.append("c"))
        gate.park()
        w.wait_idle(5)  # waiting for it opens the gate meanwhile, and parks it again
        assert ran == ["a", "b", "c"] and gate.parked
        gate.open()
    finally:
        gate.open()
        w.close()


def test_a_long_pipelined_run_keeps_only_the_batches_in_flight(tmp_path):
    """Handles, tickets and the tensors they hold are freed once their batch is done:
    a handle linking to the batch it starts (``next``) must not chain every batch since
    the first to the first (memory growing each step, and every allocation of the
    prefetch thread on fresh pages)."""
    import gc

    from hiermem.nn.pipeline import _Handle

    T, R, D, B = 2, 50, 4, 8
    g = torch.Generator().manual_seed(0)
    batches = [hm.SparseFeatures(("t0", "t1"), torch.randint(0, R, (2 * T * B,), generator=g),
                                 torch.full((T * B,), 2)) for _ in range(80)]
    cfg = hm.StoreConfig(path=tmp_path / "s", optimizer=hm.SGD(lr=0.1), device="cpu",
                         device_rows=40, host_rows=200)
    coll = hm.CachedEmbeddingBagCollection([hm.TableSpec(f"t{i}", R, D) for i in range(T)], cfg)

    def live():
        gc.collect()
        return sum(isinstance(o, _Handle) for o in gc.get_objects())

    counts = []
    with hm.PrefetchPipeline(iter(batches), coll, depth=2, background=True) as pipe:
        for i, f in enumerate(pipe):
            coll(f).sum().backward()
            if i in (20, 70):
                counts.append(live())
    assert counts[1] <= counts[0] <= 2 * (2 + 2 + 2), counts  # depth + 2 read ahead, the index's margin
    coll.store.close()
