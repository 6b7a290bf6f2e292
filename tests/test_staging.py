"""The CUDA step path's device-generic parts, on the CPU: packing a batch's control arrays
into one buffer (exactly the arrays the control plane made), the staged store path (the
torch plane stages on the CPU too), the pinned-buffer ring, and the deferred, masked
finiteness check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.dataplane.staging import PinnedRing, Stager, layout, pack_into, views
from reference import FlatStore


def _arrays(rng, sizes):
    out = []
    for i, n in enumerate(sizes):
        kind = i % 4
        if kind == 0:
            out.append(rng.integers(-2**62, 2**62, n, dtype=np.int64))
        elif kind == 1:
            out.append(rng.standard_normal(n).astype(np.float32))
        elif kind == 2:
            out.append(rng.integers(0, 2, n).astype(np.bool_))
        else:
            out.append(None)
    return out


@pytest.mark.parametrize("sizes", [[0], [1, 3, 5, 0], [7, 0, 9, 2, 0, 1, 1], [1000, 333, 17, 4, 2]])
def test_pack_and_views_round_trip_exactly(sizes):
    arrays = _arrays(np.random.default_rng(len(sizes)), sizes)
    offs, nbytes = layout(arrays)
    assert all(o % 8 == 0 for o in offs) and nbytes % 8 == 0
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    pack_into(buf, arrays, offs)
    for a, v in zip(arrays, views(buf, arrays, offs)):
        if a is None:
            assert v is None
            continue
        assert v.shape == a.shape and v.numpy().dtype == a.dtype
        assert np.array_equal(v.numpy(), a)


def test_stager_sends_one_buffer_and_reuses_it():
    st = Stager(torch.device("cpu"))
    rng = np.random.default_rng(0)
    for sizes in ([4, 8, 3], [100, 1, 1], [4, 8, 3]):
        arrays = _arrays(rng, sizes)
        got = st.send(arrays, pack=True)
        for a, v in zip(arrays, got):
            assert (v is None) if a is None else np.array_equal(v.numpy(), a)
        # the views share one buffer (one copy), not the ring's (rewritten next send)
        ptrs = {v.untyped_storage().data_ptr() for v in got if v is not None}
        assert len(ptrs) == 1
    assert len(st.ring) == 1  # no copy in flight on the CPU: the one buffer is reused
    plain = st.send([np.arange(3)], pack=False)[0]
    assert plain.tolist() == [0, 1, 2]


def test_pinned_ring_grows_for_larger_requests():
    ring = PinnedRing(pinned=False)
    a = ring.take(10)
    ring.done(a)
    b = ring.take(5000)
    assert b.numel() == 5000 and len(ring) == 2
    assert ring.take(3).numel() == 3 and len(ring) == 2


def _train_bags(tmp_path, plane, steps=25, seed=0, defer=False, nan_at=()):
    tables = [hm.TableSpec("a", 300, 4), hm.TableSpec("b", 200, 6), hm.TableSpec("h", None, 4)]
    cfg = hm.StoreConfig(path=tmp_path / f"s-{plane}-{defer}", device_rows=24, host_rows=40, optimizer=hm.Adam(lr=0.05))
    store = hm.HierarchicalStore(tables, cfg)
    store.data_plane = plane
    store.defer_nonfinite = defer
    g = torch.Generator().manual_seed(seed)
    outs, errors = [], 0
    for step in range(steps):
        B = 6
        t = torch.randint(0, 3, (B,), generator=g).repeat_interleave(3)
        k = torch.randint(0, 200, (3 * B,), generator=g)
        k = torch.where(t == 2, k * 2**40, k)
        order = torch.argsort(t, stable=True)
        t, k = t[order], k[order]
        offsets = torch.arange(0, 3 * B, 3)
        out = store.lookup_bags(t, k, offsets, mode="mean")
        outs.append(out.clone())
        grad = torch.randn(out.shape, generator=g)
        if step in nan_at:
            grad[0, 0] = float("nan")
        try:
            store.update_bags(t, k, offsets, grad, mode="mean")
        except hm.NonFiniteGradientError:
            errors += 1
    steps_done = list(store._steps)
    store.flush()
    s = store.stats()
    store.close()
    return outs, s, steps_done, errors


def test_staged_path_equals_the_compiled_plane(tmp_path):
    """The torch plane stages its control arrays (as on CUDA); every pooled output and
    counter equals the compiled plane's (rows cross device, host and disk)."""
    a, sa, _, _ = _train_bags(tmp_path, "compiled")
    b, sb, _, _ = _train_bags(tmp_path, "torch")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    for name in ("a", "b", "h"):
        assert sa[name] == sb[name]
    keep = ("bytes_host_to_device", "bytes_device_to_host", "bytes_disk_to_host", "updates")
    assert {k: sa["_store"][k] for k in keep} == {k: sb["_store"][k] for k in keep}
    assert sb["_store"]["bytes_device_to_host"] > 0 and sb["_store"]["bytes_host_to_disk"] > 0


def test_staged_arrays_are_the_control_planes(tmp_path):
    """What a step stages is exactly what the CPU placement and batch hold."""
    tables = [hm.TableSpec("a", 100, 4)]
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device_rows=8, host_rows=16))
    store.data_plane = "torch"
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        k = torch.randint(0, 100, (10,), generator=g)
        t = torch.zeros_like(k)
        offsets = torch.tensor([0, 4, 7])
        store.lookup_bags(t, k, offsets)
        m = store._bags.memo
        d, p, b = m.p.dev, m.p, m.b
        assert torch.equal(d.slot, p.slot) and torch.equal(d.inverse, b.inverse)
        assert torch.equal(d.perm, b.perm) and torch.equal(d.starts, b.starts)
        assert torch.equal(d.offsets, offsets) and torch.equal(d.src, m.bag.index_select(0, b.perm))
        if p.on_device is None:
            assert torch.equal(d.ids_slot, p.slot.index_select(0, b.inverse))
        else:
            assert torch.equal(d.dev_idx, p.on_device.nonzero().squeeze(1))
            assert torch.equal(d.host_idx, (~p.on_device).nonzero().squeeze(1))
        store.update_bags(t, k, offsets, torch.randn(3, 4, generator=g))
    store.close()


def test_deferred_nonfinite_check_changes_nothing_and_raises_next(tmp_path):
    """The CUDA design, run on the CPU: NaN gradients are masked on the device (no row
    changes), the error comes at the next update, and the step count is undone, so the
    run equals one where the bad batch's update was never made."""
    ref, sref, steps_ref, _ = _train_bags(tmp_path / "ref", "torch", nan_at=(7,))  # immediate check
    got, sgot, steps_got, errors = _train_bags(tmp_path / "deferred", "torch", defer=True, nan_at=(7,))
    # the immediate check refused step 7 at once; deferred: step 7 masked, refused at step 8
    # (whose update is then not applied either), so compare up to step 8's lookup
    for x, y in zip(ref[:9], got[:9]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert errors == 1


def test_deferred_check_undoes_the_step_count(tmp_path):
    tables = [hm.TableSpec("a", 50, 3)]
    opt = hm.Adam(lr=0.1)
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device_rows=8, host_rows=8,
                                                        optimizer=opt))
    store.data_plane = "torch"
    store.defer_nonfinite = True
    ref = FlatStore(tables, opt)
    ids = torch.tensor([1, 2, 2, 5])
    good = torch.ones(4, 3)
    store.lookup("a", ids)
    store.update("a", ids, good)
    ref.update("a", ids, good)
    bad = good.clone()
    bad[1, 1] = float("inf")
    store.update("a", ids, bad)  # masked: no row changes; not raised yet
    torch.testing.assert_close(store.lookup("a", ids), ref.lookup("a", ids))
    with pytest.raises(hm.NonFiniteGradientError, match="earlier update"):
        store.update("a", ids, good)  # reports the earlier one, applies nothing
    assert store._steps == [1]
    store.update("a", ids, good)
    ref.update("a", ids, good)
    torch.testing.assert_close(store.lookup("a", ids), ref.lookup("a", ids), atol=1e-6, rtol=1e-5)
    store.update("a", ids, bad)
    store.close()  # a pending refused update at close: undone, nothing raised
    again = hm.HierarchicalStore.open(tmp_path / "s")
    assert again._steps == [2]
    torch.testing.assert_close(again.lookup("a", ids), ref.lookup("a", ids), atol=1e-6, rtol=1e-5)
    again.close()


def test_deferred_check_keeps_the_pooled_nonfinite_contract(tmp_path):
    """test_dataplane's NaN/inf/overflow cases, deferred: each refused update changes no
    row and is reported by the next store call that reads the flag (here a flush); NaN
    in an empty bag's gradient reaches no row and is no error.  (Unlike the immediate
    check, the refused update's rows were marked dirty: written down unchanged.)"""
    store = hm.HierarchicalStore([hm.TableSpec("t", 20, 4)], hm.StoreConfig(path=tmp_path / "s", device_rows=20,
                                                                           host_rows=4, optimizer=hm.SGD(lr=0.1)))
    store.data_plane = "torch"
    store.defer_nonfinite = True
    ids, offsets = torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2, 2])
    every = torch.arange(20)
    before = store.lookup("t", every).clone()
    nan, inf, big = torch.ones(3, 4), torch.ones(3, 4), torch.full((3, 4), 3e38)
    nan[0, 1], inf[2, 3] = float("nan"), float("inf")
    for g, psw in ((nan, None), (inf, None), (big, None), (torch.ones(3, 4), torch.tensor([1, 1, np.inf, 1.]))):
        store.update_pooled("t", ids, offsets, g, per_sample_weights=psw)  # masked, not raised yet
        with pytest.raises(hm.NonFiniteGradientError, match="earlier update"):
            store.flush()
        torch.testing.assert_close(store.lookup("t", every), before, atol=0, rtol=0)
    assert store._steps == [0]
    g = torch.ones(3, 4)
    g[1] = float("nan")  # bag 1 is empty
    store.update_pooled("t", ids, offsets, g)
    store.flush()
    assert bool(torch.isfinite(store.export("t")[1]).all()) and store._steps == [1]
    store.close()
