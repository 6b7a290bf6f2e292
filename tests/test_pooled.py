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
