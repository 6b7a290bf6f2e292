"""The store on a CUDA device tier (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

import hiermem as hm
from reference import FlatStore

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("opt", [hm.SGD(lr=0.2), hm.RowWiseAdagrad(lr=0.1), hm.Adam(lr=0.02)], ids=lambda o: o.name)
def test_cuda_store_matches_flat_reference(tmp_path, opt):
    tables = [hm.TableSpec("a", 500, 16), hm.TableSpec("h", None, 8)]
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device="cuda", device_rows=32,
                                                        host_rows=64, optimizer=opt))
    assert store._host.data.is_pinned()
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
