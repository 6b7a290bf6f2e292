"""lookup_pooled / update_pooled equal nn.EmbeddingBag + torch.optim.SGD."""

from __future__ import annotations

import pytest
import torch

import hiermem as hm

N, DIM = 200, 8


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("tiers", [(256, 64), (12, 40)], ids=["all-device", "device+host+disk"])
def test_pooled_matches_embedding_bag(tmp_path, mode, weighted, tiers):
    store = hm.HierarchicalStore([hm.TableSpec("t", N, DIM)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=tiers[0], host_rows=tiers[1],
                                                optimizer=hm.SGD(lr=0.5)))
    init = torch.cat([store.lookup("t", torch.arange(i, i + 10)) for i in range(0, N, 10)])
    bag = torch.nn.EmbeddingBag(N, DIM, mode=mode, sparse=True)
    with torch.no_grad():
        bag.weight.copy_(init)
    opt = torch.optim.SGD(bag.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        lengths = torch.randint(0, 5, (6,), generator=g)  # empty bags included
        ids = torch.randint(0, N, (int(lengths.sum()),), generator=g)
        offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]))
        psw = torch.rand(ids.numel(), generator=g) if weighted else None
        want = bag(ids, offsets, per_sample_weights=psw)
        got = store.lookup_pooled("t", ids, offsets, mode=mode, per_sample_weights=psw)
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5)
        gout = torch.randn(6, DIM, generator=g)
        opt.zero_grad()
        want.backward(gout)
        opt.step()
        store.update_pooled("t", ids, offsets, gout, mode=mode, per_sample_weights=psw)
    final = torch.cat([store.lookup("t", torch.arange(i, i + 10)) for i in range(0, N, 10)])
    torch.testing.assert_close(final, bag.weight.detach(), atol=1e-6, rtol=1e-5)
    store.close()


def test_bad_offsets(tmp_path):
    store = hm.HierarchicalStore([hm.TableSpec("t", N, DIM)], hm.StoreConfig(path=tmp_path / "s", device_rows=8,
                                                                             host_rows=8))
    ids = torch.tensor([1, 2, 3])
    for offs in (torch.tensor([1, 2]), torch.tensor([0, 5]), torch.tensor([0, 2, 1]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(hm.InvalidArgumentError):
            store.lookup_pooled("t", ids, offs)
    with pytest.raises(hm.InvalidTypeError):
        store.lookup_pooled("t", ids, torch.tensor([0.0]))
    with pytest.raises(hm.InvalidArgumentError):
        store.lookup_pooled("t", ids, torch.tensor([0]), per_sample_weights=torch.ones(2))
    with pytest.raises(hm.NonFiniteGradientError):
        store.update_pooled("t", ids, torch.tensor([0]), torch.full((1, DIM), float("nan")))
    store.close()


def _two_stores(tmp_path, plane, dims=(DIM, DIM)):
    tables = [hm.TableSpec(f"t{i}", N, d) for i, d in enumerate(dims)]
    cfg = dict(device_rows=40, host_rows=300, optimizer=hm.Adagrad(lr=0.3))
    stores = [hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / f"s{j}-{plane}", **cfg)) for j in range(2)]
    for s in stores:
        s.data_plane = plane
    return stores


@pytest.mark.parametrize("plane", ["compiled", "torch"])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_sample_major_bags_equal_the_table_major_ones_transposed(tmp_path, plane, mode, weighted):
    """``samples=B``: the pooled bags come out ``[B, T*D]`` (a collection's layout, written
    there by the pooling) and the gradient goes in so: the same numbers, bit for bit, as
    the table-major lookup and update with the transposes done by torch."""
    a, b = _two_stores(tmp_path, plane)
    T, B, D = 2, 5, a.max_dim
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        lengths = torch.randint(0, 4, (T * B,), generator=g)  # empty bags included
        n = int(lengths.sum())
        t = torch.repeat_interleave(torch.arange(T), lengths.view(T, B).sum(1))
        ids = torch.randint(0, N, (n,), generator=g)
        offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]))
        psw = torch.rand(n, generator=g) if weighted else None
        want = a.lookup_bags(t, ids, offsets, mode, psw).view(T, B, D).transpose(0, 1).reshape(B, T * D)
        got = b.lookup_bags(t, ids, offsets, mode, psw, samples=B)
        assert got.shape == (B, T * D)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        gout = torch.randn(B, T * D, generator=g)
        a.update_bags(t, ids, offsets, gout.view(B, T, D).transpose(0, 1).reshape(T * B, D), mode, psw)
        b.update_bags(t, ids, offsets, gout, mode, psw, samples=B)
    for name in ("t0", "t1"):
        ia, ra = a.export(name)
        ib, rb = b.export(name)
        torch.testing.assert_close(ia, ib, rtol=0, atol=0)
        torch.testing.assert_close(ra, rb, rtol=0, atol=0)
    a.close()
    b.close()


def test_bad_samples_are_refused_and_change_nothing(tmp_path):
    (s, ref) = _two_stores(tmp_path, "compiled")
    t, ids, offsets = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3])
    for bad in (0, -2, 3, 2.0, True):  # 4 bags: 3 does not divide them
        with pytest.raises(hm.InvalidArgumentError, match="samples"):
            s.lookup_bags(t, ids, offsets, samples=bad)
        with pytest.raises(hm.InvalidArgumentError, match="samples"):
            s.update_bags(t, ids, offsets, torch.ones(2, 2 * DIM), samples=bad)
    s.lookup_bags(t, ids, offsets, samples=2)
    with pytest.raises(hm.InvalidArgumentError, match="grad must be"):  # the table-major shape, given samples
        s.update_bags(t, ids, offsets, torch.ones(4, DIM), samples=2)
    for name in ("t0", "t1"):
        torch.testing.assert_close(s.export(name)[1], ref.export(name)[1], rtol=0, atol=0)
    s.close()
    ref.close()
