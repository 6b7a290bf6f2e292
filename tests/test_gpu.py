"""The store on a CUDA device tier (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import hiermem as hm
from hiermem.observe.stats import IO
from reference import FlatStore

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("opt", [hm.SGD(lr=0.2), hm.RowWiseAdagrad(lr=0.1), hm.Adam(lr=0.02)], ids=lambda o: o.name)
def test_cuda_store_matches_flat_reference(tmp_path, opt):
    tables = [hm.TableSpec("a", 500, 16), hm.TableSpec("h", None, 8)]
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device="cuda", device_rows=32,
                                                        host_rows=64, optimizer=opt))
    assert store.host_tier.page_locked and not store.host_tier.uniform  # the mixed-width arena
    ref = FlatStore(tables, opt)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        for name, hi in (("a", 500), ("h", 2**62)):
            ids = torch.randint(0, hi, (40,), generator=g) if name == "a" else \
                torch.randint(0, 200, (40,), generator=g) * (2**40)
            dim = 16 if name == "a" else 8
            rows = store.lookup(name, ids.cuda())
            assert rows.device.type == "cuda"
            torch.testing.assert_close(rows.cpu(), ref.lookup(name, ids), atol=1e-6, rtol=1e-5)
            grads = torch.randn(40, dim, generator=g)
            store.update(name, ids.cuda(), grads.cuda())
            ref.update(name, ids, grads)
        if step % 10 == 9:
            store.flush()
    store.audit()
    store.close()
    again = hm.HierarchicalStore.open(tmp_path / "s")
    ids = torch.arange(0, 500, 7)
    torch.testing.assert_close(again.lookup("a", ids.cuda()).cpu(), ref.lookup("a", ids), atol=1e-6, rtol=1e-5)
    again.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_cuda_module_with_prefetch_matches_plain_embedding_bags(tmp_path, depth):
    """The fused module on a CUDA device tier, prefetching on a side stream from pinned host memory."""
    from test_modules import _train

    ref_losses, ref_final, _ = _train("plain", "rowwise_adagrad", 20, tmp_path)
    cuda_args = dict(device="cuda")
    losses, final, _ = _train("hm", "rowwise_adagrad", 20, tmp_path, depth=depth, **cuda_args)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)  # GPU matmuls
    for n in ref_final:
        torch.testing.assert_close(final[n].cpu(), ref_final[n], rtol=1e-4, atol=1e-5)


# -- the CUDA step path: one staging copy per batch, rows on a side stream, no sync ------

def _bag_batches(steps, seed, tables, per_bag=3, B=8):
    """Multi-table bag batches over ``tables`` (name, rows; None: hashed ids)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        t = torch.arange(len(tables)).repeat_interleave(B * per_bag)
        k = torch.cat([torch.randint(0, n or 300, (B * per_bag,), generator=g) * (1 if n else 2**40)
                       for _, n in tables])
        offsets = torch.arange(0, t.numel(), per_bag)
        psw = torch.rand(t.numel(), generator=g) + 0.5
        yield t, k, offsets, psw, torch.randn(offsets.numel(), 8, generator=g)


@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("opt", [hm.SGD(lr=0.2), hm.Adam(lr=0.02)], ids=lambda o: o.name)
def test_cuda_bags_across_tiers_match_the_cpu_store(tmp_path, mode, opt):
    """lookup_bags/update_bags on a CUDA store whose rows cross device, host and disk
    equal a CPU store's, with one staging copy per batch and the device's rows moved on
    the side stream."""
    from hiermem.dataplane import staging

    spec = [("a", 400), ("b", 150), ("h", None)]
    tables = [hm.TableSpec(n, r, 8) for n, r in spec]
    stores = [hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / dev, device=dev, device_rows=40,
                                                          host_rows=60, optimizer=opt)) for dev in ("cpu", "cuda")]
    pool_mode = "sum" if mode == "weighted" else mode
    steps = 30
    for t, k, offsets, psw, grad in _bag_batches(steps, 0, spec):
        w = psw if mode == "weighted" else None
        outs = []
        for s in stores:
            dev = s.device
            wd = None if w is None else w.to(dev)
            outs.append(s.lookup_bags(t, k, offsets, pool_mode, wd))
            s.update_bags(t, k, offsets, grad.to(dev), pool_mode, wd)
        torch.testing.assert_close(outs[1].cpu(), outs[0], atol=1e-5, rtol=1e-5)
    cuda = stores[1]
    assert cuda._staged_path.stager.copies == steps  # the update reused the lookup's staged arrays
    st = cuda.stats()["_store"]
    assert st["bytes_device_to_host"] > 0 and st["bytes_host_to_disk"] > 0
    for s in stores:
        s.flush()
        s.audit()
    for name, _ in spec:
        for lo in range(0, 150, 30):
            ids = torch.arange(lo, lo + 30) * (1 if name != "h" else 2**40)
            torch.testing.assert_close(stores[1].lookup(name, ids).cpu(), stores[0].lookup(name, ids), atol=1e-5,
                                       rtol=1e-5)
    for s in stores:
        s.close()
    print("waits", dict(staging.WAITS) or "{}")


def _module_steps(module, batches, read_loss=False):
    losses = []
    for f in batches:
        out = module(f)
        loss = out.square().mean()
        loss.backward()
        if read_loss:
            losses.append(float(loss))
    return losses


def _features(steps, seed, T=3, B=64, R=600):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (T * B,), generator=g)
        vals = (torch.rand(int(lengths.sum()), generator=g) ** 2 * R).long()
        out.append(hm.SparseFeatures(tuple(f"t{i}" for i in range(T)), vals, lengths))
    return out


@pytest.mark.parametrize("device_rows,host_rows", [(2048, 16), (512, 2048)], ids=["on_device", "device_host"])
def test_cuda_steady_state_steps_never_sync(tmp_path, device_rows, host_rows):
    """Forward and fused backward of the module, ids from the CPU, under
    ``set_sync_debug_mode("error")``: no synchronising CUDA call in a step.  With a small
    device tier rows move device <-> host every step (side stream, pinned memory); the
    host tier holds every row, so nothing goes to disk (that write is an inherent sync).
    The device tier holds a whole batch (a batch overflowing to the host tier is
    updated there by the CPU: an inherent sync, see docs/dataplane.md)."""
    from hiermem.dataplane import staging

    tables = [hm.TableSpec(f"t{i}", 600, 16) for i in range(3)]
    cfg = hm.StoreConfig(path=tmp_path / "s", device="cuda", device_rows=device_rows, host_rows=host_rows,
                         optimizer=hm.RowWiseAdagrad(lr=0.05))
    module = hm.CachedEmbeddingBagCollection(tables, cfg)
    _module_steps(module, _features(10, 0))  # warm-up: every row resident, buffers grown
    torch.cuda.synchronize()
    before_copies, before_io = module.store._staged_path.stager.copies, module.store.counters.io.clone()
    waits = dict(staging.WAITS)
    steps = 20
    torch.cuda.set_sync_debug_mode("error")
    try:
        _module_steps(module, _features(steps, 1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert module.store._staged_path.stager.copies - before_copies == steps  # one control copy per batch
    moved = int(module.store.counters.io[IO.BYTES_DEVICE_TO_HOST] - before_io[IO.BYTES_DEVICE_TO_HOST])
    assert (moved > 0) == (device_rows < 600 * 3)
    blocked = {k: v - waits.get(k, 0) for k, v in staging.WAITS.items() if v != waits.get(k, 0)}
    # the only waits allowed: evictions of an earlier step landing in the host tier
    assert set(blocked) <= {"host_tier_read", "nonfinite_flag"}, blocked
    print("moved bytes", moved, "waits that blocked", blocked)
    module.store.close()


def test_cuda_nonfinite_gradients_change_nothing_and_are_reported_next(tmp_path):
    tables = [hm.TableSpec("a", 100, 4)]
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device="cuda", device_rows=16,
                                                        host_rows=16, optimizer=hm.Adam(lr=0.1)))
    assert store.defer_nonfinite
    ids = torch.tensor([3, 4, 4, 9])
    before = store.lookup("a", ids).clone()
    bad = torch.ones(4, 4, device="cuda")
    bad[2, 0] = float("nan")
    store.update("a", ids, bad)  # no sync: masked on the device
    torch.testing.assert_close(store.lookup("a", ids), before)
    with pytest.raises(hm.NonFiniteGradientError, match="earlier update"):
        store.update("a", ids, torch.ones(4, 4, device="cuda"))
    assert store._steps == [0]
    torch.testing.assert_close(store.lookup("a", ids), before)
    store.close()


# -- the model-based exactness machine of tests/test_store_exact.py on a CUDA store -----

def _cuda_machines():
    from hypothesis import HealthCheck, settings

    from test_store_exact import StoreMachine

    out = {}
    for opt in (hm.SGD(lr=0.3), hm.Adam(lr=0.05)):
        cls = type(f"CudaStoreMachine_{opt.name}", (StoreMachine,), {"optimizer": opt, "policy": "lru",
                                                                    "device": "cuda"})
        cls.TestCase.settings = settings(max_examples=8, stateful_step_count=25, deadline=None,
                                         suppress_health_check=list(HealthCheck))
        out[f"Test{cls.__name__}"] = pytest.mark.gpu(cls.TestCase)
    return out


globals().update(_cuda_machines())
