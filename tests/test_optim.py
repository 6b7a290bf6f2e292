"""The row optimizers match torch's optimizers on the touched rows, through the store."""

from __future__ import annotations

import pytest
import torch

import hiermem as hm

N, DIM, STEPS = 50, 8, 6


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, N, (30,), generator=g)  # duplicates: grads are summed
        out.append((ids, torch.randn(30, DIM, generator=g)))
    return out


def _train_torch(make_opt, init):
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    opt = make_opt(emb.parameters())
    for ids, grad in _batches():
        opt.zero_grad()
        out = emb(ids)
        out.backward(grad)  # d(sum(out * grad)) / d out = grad
        opt.step()
    return emb.weight.detach()


def _train_store(tmp_path, opt):
    store = hm.HierarchicalStore([hm.TableSpec("t", N, DIM)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=8, host_rows=24, optimizer=opt))
    init = store.lookup("t", torch.arange(N)[:20]).clone()
    init = torch.cat([init, store.lookup("t", torch.arange(20, 40)), store.lookup("t", torch.arange(40, N))])
    for ids, grad in _batches():
        store.update("t", ids, grad)
    final = torch.cat([store.lookup("t", torch.arange(i, min(i + 20, N))) for i in range(0, N, 20)])
    store.close()
    return init, final


CASES = [
    (hm.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (hm.Adagrad(lr=0.1, eps=1e-10), lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10)),
    (hm.Adagrad(lr=0.1, initial_accumulator_value=0.5),
     lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.5)),
    (hm.Adam(lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01)),
    (hm.Adam(lr=0.02, beta1=0.8, beta2=0.99, eps=1e-6),
     lambda p: torch.optim.SparseAdam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-6)),
]


@pytest.mark.parametrize("opt,make", CASES, ids=lambda c: getattr(c, "name", ""))
def test_matches_torch_optimizer(tmp_path, opt, make):
    init, final = _train_store(tmp_path, opt)
    want = _train_torch(make, init)
    torch.testing.assert_close(final, want, atol=1e-6, rtol=1e-5)


def test_rowwise_adagrad_formula(tmp_path):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: acc += mean(g^2); w -= lr * g / (sqrt(acc) + eps)."""
    lr, eps = 0.1, 1e-8
    init, final = _train_store(tmp_path, hm.RowWiseAdagrad(lr=lr, eps=eps))
    w, acc = init.clone(), torch.zeros(N)
    for ids, grad in _batches():
        u, inv = torch.unique(ids, return_inverse=True)
        g = torch.zeros(len(u), DIM).index_add_(0, inv, grad)
        acc[u] += (g * g).mean(1)
        w[u] -= lr * g / (acc[u].sqrt() + eps).unsqueeze(1)
    torch.testing.assert_close(final, w, atol=1e-6, rtol=1e-5)


def test_optimizer_state_moves_with_rows(tmp_path):
    """Adagrad state survives eviction to disk: a tiny cache equals a cache holding everything."""
    outs = []
    for i, (d, h) in enumerate(((2, 3), (64, 64))):
        s = hm.HierarchicalStore([hm.TableSpec("t", N, DIM)],
                                 hm.StoreConfig(path=tmp_path / f"s{i}", device_rows=d, host_rows=h,
                                                optimizer=hm.Adagrad(lr=0.1)))
        for ids, grad in _batches(1):
            for j in range(0, 30, 5):
                s.update("t", ids[j:j + 5], grad[j:j + 5])
        outs.append(torch.cat([s.lookup("t", torch.arange(k, k + 5)) for k in range(0, N, 5)]))
        s.close()
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(lr=float("nan"))])
def test_bad_hyperparameters(bad):
    with pytest.raises(ValueError):
        hm.SGD(**bad)
    with pytest.raises(ValueError):
        hm.Adam(beta1=1.0)
