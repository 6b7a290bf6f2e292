"""The data planes: the compiled CPU kernels equal the torch path and nn.EmbeddingBag +
torch's optimizers; the compiled dedup equals a stable torch sort.

Tolerances: allclose 1e-5.  Both planes add in the same order (a bag's rows, and a
row's gradients, in input order); torch's vectorised kernels may fuse a multiply and an
add where the compiled kernels round twice, a float32 ulp per operation, and
``torch.optim``'s sparse optimizers coalesce a row's gradients in their own order.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hiermem as hm
from hiermem.dataplane import CompiledPlane, TorchPlane
from hiermem.dataplane.batch import sorted_runs
from hiermem.store.placed import runs

OPTS = [hm.SGD(lr=0.3), hm.Adagrad(lr=0.2, initial_accumulator_value=0.1), hm.RowWiseAdagrad(lr=0.2),
        hm.Adam(lr=0.05, beta1=0.8, beta2=0.95)]
TIERS = {"all-device": (400, 16), "device+host+disk": (14, 30)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = dict(atol=1e-5, rtol=1e-5)


def _bag_batches(steps, seed, T, hi, weighted, max_len=5, B=7):
    """Batches of bags (one table each, ``B`` bags per table, empty bags included,
    skewed ids so rows repeat within and across bags): (tables, ids, offsets, psw, grad)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, max_len, (T * B,), generator=g)
        lengths[0] = 0  # an empty bag in every batch
        tabs = torch.repeat_interleave(torch.arange(T), B)
        t = torch.repeat_interleave(tabs, lengths)
        r = (torch.rand(int(lengths.sum()), generator=g) ** 2 * 40).long()
        k = torch.where(t == T - 1, r * hi[-1], r) if hi[-1] > 1 else r  # last table: spread ids
        offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]))
        psw = torch.rand(k.numel(), generator=g) + 0.5 if weighted else None
        out.append((t, k, offsets, psw, torch.randn(T * B, 8, generator=g)))
    return out


def _run_bags(tmp_path, name, plane, opt, tiers, mode, weighted, tables, device="cpu", steps=8):
    """Train ``tables`` with lookup_bags/update_bags; (pooled per step, final records)."""
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / name, device_rows=tiers[0],
                                                        host_rows=tiers[1], optimizer=opt, device=device))
    store.data_plane = plane
    assert store.data_plane == plane
    hi = [1] * (len(tables) - 1) + [2**40 if tables[-1].num_rows is None else 1]
    pooled = []
    for t, k, offsets, psw, grad in _bag_batches(steps, 0, len(tables), hi, weighted):
        dev = lambda x: None if x is None else x.to(device)  # noqa: E731
        out = store.lookup_bags(dev(t), dev(k), dev(offsets), mode, dev(psw))
        pooled.append(out.cpu())
        store.update_bags(dev(t), dev(k), dev(offsets), dev(grad)[:, :store.max_dim], mode, dev(psw))
    recs = {s.name: store.export(s.name) for s in tables}
    store.audit()
    store.close()
    return pooled, recs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", list(TIERS), ids=list(TIERS))
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)], ids=["sum", "mean", "psw"])
@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.name)
def test_compiled_plane_matches_torch_plane(tmp_path, opt, mode, weighted, tiers, device):
    """Every optimizer, sum/mean/weights, bounded + unbounded tables of two dims, rows on
    the device only or spread over device, host and disk: same pooled rows, same records."""
    tables = [hm.TableSpec("a", 60, 8), hm.TableSpec("b", 50, 4), hm.TableSpec("u", None, 8)]
    args = (opt, TIERS[tiers], mode, weighted, tables, device)
    want_p, want_r = _run_bags(tmp_path, "torch", "torch", *args)
    got_p, got_r = _run_bags(tmp_path, "compiled", "compiled", *args)
    for g, w, in zip(got_p, want_p):
        # columns past a bag's table dim are meaningless (other tables' state): compare 4
        torch.testing.assert_close(g[:, :4], w[:, :4], **TOL)
    for name in want_r:
        gi, gr = got_r[name]
        wi, wr = want_r[name]
        torch.testing.assert_close(gi, wi)
        torch.testing.assert_close(gr, wr, **TOL)


@pytest.mark.parametrize("dims", [(16,), (64,), (12,), (16, 64)], ids=["16", "64", "12", "16+64"])
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)], ids=["sum", "mean", "psw"])
@pytest.mark.parametrize("opt", OPTS[:2], ids=lambda o: o.name)
def test_compiled_plane_wide_rows(tmp_path, opt, mode, weighted, dims):
    """Row widths the kernels specialise (16, 64: vector registers), a width with a scalar
    tail (12) and mixed widths (the generic path), rows on every tier: same as torch."""
    tables = [hm.TableSpec(f"t{i}", 60, d) for i, d in enumerate(dims)] + [hm.TableSpec("u", None, dims[-1])]
    out = {}
    for plane in ("torch", "compiled"):
        store = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / plane, device_rows=40, host_rows=60,
                                                            optimizer=opt))
        store.data_plane = plane
        g = torch.Generator().manual_seed(1)
        hi = [1] * (len(tables) - 1) + [2**40]
        pooled = []
        for t, k, offsets, psw, _ in _bag_batches(6, 1, len(tables), hi, weighted):
            pooled.append(store.lookup_bags(t, k, offsets, mode, psw))
            grad = torch.randn(offsets.numel(), store.max_dim, generator=g)
            store.update_bags(t, k, offsets, grad, mode, psw)
        out[plane] = pooled, {s.name: store.export(s.name) for s in tables}
        store.close()
    d = min(dims)
    for got, want in zip(out["compiled"][0], out["torch"][0]):
        torch.testing.assert_close(got[:, :d], want[:, :d], **TOL)
    for name, (wi, wr) in out["torch"][1].items():
        gi, gr = out["compiled"][1][name]
        torch.testing.assert_close(gi, wi)
        torch.testing.assert_close(gr, wr, **TOL)


class _RowWiseAdagradRef:
    """FBGEMM's row-wise Adagrad on a sparse gradient: acc += mean(g^2); w -= lr g / (sqrt(acc) + eps)."""

    def __init__(self, params, lr, eps):
        self.params, self.lr, self.eps = list(params), lr, eps
        self.acc = [torch.zeros(p.shape[0]) for p in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        for p, acc in zip(self.params, self.acc):
            g = p.grad.coalesce()
            i, v = g.indices()[0], g.values()
            acc[i] += v.square().mean(1)
            p.data[i] -= self.lr * v / (acc[i].sqrt() + self.eps).unsqueeze(1)


TORCH_OPTS = {
    "sgd": (hm.SGD(lr=0.3), lambda p: torch.optim.SGD(p, lr=0.3)),
    "adagrad": (hm.Adagrad(lr=0.2, initial_accumulator_value=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.1)),
    "rowwise_adagrad": (hm.RowWiseAdagrad(lr=0.2, eps=1e-8), lambda p: _RowWiseAdagradRef(p, 0.2, 1e-8)),
    "adam": (hm.Adam(lr=0.05, beta1=0.8, beta2=0.95),
             lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.8, 0.95))),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("tiers", list(TIERS), ids=list(TIERS))
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)], ids=["sum", "mean", "psw"])
@pytest.mark.parametrize("name", list(TORCH_OPTS))
def test_matches_embedding_bag_and_torch_optimizers(tmp_path, name, mode, weighted, tiers, bounded, device):
    """lookup_pooled/update_pooled on the default plane (compiled on CPU) against
    nn.EmbeddingBag(sparse=True) + torch's optimizer, empty bags and repeats included.
    An unbounded table's hashed ids (multiples of 2**40) map to the reference's rows."""
    N, DIM, B = 50, 8, 9
    opt, make = TORCH_OPTS[name]
    store = hm.HierarchicalStore([hm.TableSpec("t", N if bounded else None, DIM)],
                                 hm.StoreConfig(path=tmp_path / "s", device_rows=TIERS[tiers][0],
                                                host_rows=TIERS[tiers][1], optimizer=opt, device=device))
    assert store.data_plane == ("compiled" if device == "cpu" else "torch")
    key = (lambda r: r) if bounded else (lambda r: r * 2**40 + 7)
    every = key(torch.arange(N))
    init = torch.cat([store.lookup("t", every[i:i + 10].to(device)).cpu() for i in range(0, N, 10)])
    bag = torch.nn.EmbeddingBag(N, DIM, mode=mode, sparse=True)
    with torch.no_grad():
        bag.weight.copy_(init)
    ref = make(bag.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        lengths = torch.randint(0, 6, (B,), generator=g)
        lengths[1] = 0
        rows = (torch.rand(int(lengths.sum()), generator=g) ** 2 * N).long()
        offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]))
        psw = torch.rand(rows.numel(), generator=g) + 0.5 if weighted else None
        want = bag(rows, offsets, per_sample_weights=psw)
        ids = key(rows).to(device)
        got = store.lookup_pooled("t", ids, offsets.to(device), mode, None if psw is None else psw.to(device))
        torch.testing.assert_close(got.cpu(), want.detach(), **TOL)
        gout = torch.randn(B, DIM, generator=g)
        ref.zero_grad()
        want.backward(gout)
        ref.step()
        store.update_pooled("t", ids, offsets.to(device), gout.to(device), mode,
                            None if psw is None else psw.to(device))
    final = torch.cat([store.lookup("t", every[i:i + 10].to(device)).cpu() for i in range(0, N, 10)])
    torch.testing.assert_close(final, bag.weight.detach(), **TOL)
    store.close()


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: o.name)
def test_plain_update_matches_torch_plane(tmp_path, opt):
    """update(ids, grads [n, dim]) (no bags): each id reads its own gradient row."""
    outs = []
    for plane in ("torch", "compiled"):
        store = hm.HierarchicalStore([hm.TableSpec("t", 40, 8)], hm.StoreConfig(
            path=tmp_path / plane, device_rows=10, host_rows=20, optimizer=opt))
        store.data_plane = plane
        g = torch.Generator().manual_seed(0)
        for _ in range(6):
            ids = torch.randint(0, 40, (30,), generator=g)
            store.lookup("t", ids)
            store.update("t", ids, torch.randn(30, 8, generator=g))
        outs.append(store.export("t"))
        store.close()
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], **TOL)


def _one_store(tmp_path, name="s"):
    return hm.HierarchicalStore([hm.TableSpec("t", 20, 4)], hm.StoreConfig(path=tmp_path / name, device_rows=20,
                                                                           host_rows=4, optimizer=hm.SGD(lr=0.1)))


def test_nonfinite_gradient_changes_nothing(tmp_path):
    """NaN/inf in a gradient that reaches a row, or per-row sums that overflow float32,
    raise NonFiniteGradientError before any row changes; NaN in the gradient of an empty
    bag reaches no row and is not an error (as on the torch plane)."""
    store = _one_store(tmp_path)
    assert isinstance(store.plane, CompiledPlane)
    ids, offsets = torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2, 2])
    before = store.export("t")[1].clone()
    for bad in (float("nan"), float("inf")):
        g = torch.ones(3, 4)
        g[0, 1] = bad
        with pytest.raises(hm.NonFiniteGradientError):
            store.update_pooled("t", ids, offsets, g)
        torch.testing.assert_close(store.export("t")[1], before)
    big = torch.full((3, 4), 3e38)  # finite, but row 2 sums two of them
    with pytest.raises(hm.NonFiniteGradientError):
        store.update_pooled("t", ids, offsets, big)
    torch.testing.assert_close(store.export("t")[1], before)
    with pytest.raises(hm.NonFiniteGradientError):
        store.update_pooled("t", ids, offsets, torch.ones(3, 4), per_sample_weights=torch.tensor([1, 1, np.inf, 1.]))
    torch.testing.assert_close(store.export("t")[1], before)
    g = torch.ones(3, 4)
    g[1] = float("nan")  # bag 1 is empty
    store.update_pooled("t", ids, offsets, g)
    assert bool(torch.isfinite(store.export("t")[1]).all())
    store.close()


def test_threads_follow_torch(tmp_path):
    """The kernels run on as many threads as torch's intra-op pool, or on one for small work."""
    import numba

    from hiermem.dataplane.planes import PARALLEL_WORK

    store = hm.HierarchicalStore([hm.TableSpec("t", 5000, 64)], hm.StoreConfig(path=tmp_path / "s", device_rows=5000,
                                                                               host_rows=4))
    n = torch.get_num_threads()
    big = torch.arange(PARALLEL_WORK // 64 + 1) % 5000
    try:
        torch.set_num_threads(1)
        store.lookup_pooled("t", big, torch.tensor([0]))
        assert numba.get_num_threads() == 1
        torch.set_num_threads(n)
        store.lookup_pooled("t", big, torch.tensor([0]))
        assert numba.get_num_threads() == min(n, numba.config.NUMBA_NUM_THREADS)
        store.lookup_pooled("t", torch.tensor([1, 2]), torch.tensor([0]))
        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)
        store.close()


_KEEPS_TORCH_THREADS = r"""
import os, sys, torch
torch.set_num_threads(1)
import hiermem as hm
store = hm.HierarchicalStore([hm.TableSpec("t", 5000, 64)],
                             hm.StoreConfig(path=sys.argv[1], device_rows=5000, host_rows=4))
big = torch.arange(1 << 13) % 5000
for _ in range(3):  # the first parallel kernel of the process runs on this (the training) thread
    store.lookup_pooled("t", big, torch.tensor([0]))
    torch.ones(1 << 20).add_(1)  # a torch op big enough to run on torch's intra-op threads
store.close()
print(torch.get_num_threads())
"""


def test_numba_pool_keeps_torch_threads(tmp_path):
    """Starting numba's thread pool (its OpenMP layer shares torch's libgomp) leaves torch's
    intra-op count as the user set it: a process that asked for one torch thread keeps
    one, so no second OpenMP thread spins on the core the prefetch thread runs on."""
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _KEEPS_TORCH_THREADS, str(tmp_path / "s")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"


def test_unknown_plane_and_subclassed_optimizer(tmp_path):
    """A plane is chosen by name; an optimizer the kernels do not know (a subclass) runs
    on the torch plane's ops with its own math."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class DoubleSGD(hm.SGD):
        def apply(self, rec, grad, dim, step):
            rec[:, :dim].add_(grad, alpha=-2 * self.lr)

    store = _one_store(tmp_path)
    with pytest.raises(hm.InvalidArgumentError):
        store.data_plane = "fast"
    assert store.data_plane == "compiled"
    store.close()
    s2 = hm.HierarchicalStore([hm.TableSpec("t", 20, 4)], hm.StoreConfig(path=tmp_path / "d", device_rows=20,
                                                                         host_rows=4, optimizer=DoubleSGD(lr=0.1)))
    w0 = s2.lookup("t", torch.tensor([3])).clone()
    s2.update("t", torch.tensor([3]), torch.ones(1, 4))
    torch.testing.assert_close(s2.lookup("t", torch.tensor([3])), w0 - 0.2)
    s2.close()
    assert isinstance(TorchPlane(), TorchPlane)


def _torch_runs(x, t=None):
    if t is None:
        s, perm = torch.sort(x, stable=True)
        differs = s[1:] != s[:-1]
    else:
        o1 = torch.argsort(x, stable=True)
        perm = o1.index_select(0, torch.argsort(t.index_select(0, o1), stable=True))
        ts, xs = t[perm], x[perm]
        differs = (ts[1:] != ts[:-1]) | (xs[1:] != xs[:-1])
    starts, inverse, counts, lastpos = runs(perm, differs)
    return perm, starts, inverse, counts, lastpos


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), max_size=60), st.integers(0, 3), st.integers(1, 40), st.booleans())
def test_compiled_dedup_equals_stable_sort(vals, ntables, hi, lex):
    """Same permutation, runs, inverse, counts and last positions as torch's stable sort,
    for keys of any span (small ranges with many repeats, and full 63-bit ids)."""
    x = torch.tensor(vals, dtype=torch.int64)
    if hi < 20:
        x = x % hi
    t = (x * 7 + 3) % (ntables + 1) if lex else None
    got = sorted_runs(x, t)
    want = _torch_runs(x, t)
    for g, w in zip(got[:5], want):
        assert torch.equal(g, w)
    assert torch.equal(got[5], x[want[0][want[1]]])
    if lex:
        assert torch.equal(got[6], t[want[0][want[1]]])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 9)), max_size=50))
def test_compiled_dedup_over_linearised_tables(pairs):
    """Tables laid end to end (sizes 10, 10, 10): sorted by ``off[t] + k``, reported as (t, k)."""
    t = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    k = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    off = np.array([0, 10, 20], dtype=np.int64)
    got = sorted_runs(k, t, off)
    want = _torch_runs(t * 10 + k)
    for g, w in zip(got[:5], want):
        assert torch.equal(g, w)
    first = want[0][want[1]]
    assert torch.equal(got[5], k[first]) and torch.equal(got[6], t[first])


def test_table_of_every_id():
    from hiermem.dataplane.batch import repeat

    lengths = np.array([2, 0, 1, 3, 0, 0], dtype=np.int64)  # 3 keys x 2 samples
    assert repeat(np.array([5, 7, 9], dtype=np.int64), lengths, 2).tolist() == [5, 5, 7, 7, 7, 7]


def test_compiled_dedup_large():
    g = torch.Generator().manual_seed(3)
    for n, hi in ((100_000, 4_000_000), (50_000, 2**62), (10_000, 1)):
        x = torch.randint(0, hi, (n,), generator=g)
        got, want = sorted_runs(x), _torch_runs(x)
        assert all(torch.equal(a, b) for a, b in zip(got[:5], want))


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_kernels_compiled_equal_interpreted(tmp_path, opt):
    """Every data-plane kernel, compiled and run as plain Python (NUMBA_DISABLE_JIT=1),
    gives bit-identical pooled rows and records."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    driver = Path(__file__).parent / "dataplane_parity_driver.py"
    out = []
    for jit, sub in (("0", "compiled"), ("1", "interpreted")):
        env = {**os.environ, "NUMBA_DISABLE_JIT": jit}
        r = subprocess.run([sys.executable, str(driver), opt, str(tmp_path / sub)], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(r.stdout.strip().splitlines()[-1])
    assert out[0] == out[1]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(1, 40), st.integers(0, 40), st.booleans())
def test_swap_rows_equals_three_copies(seed, n_up, n_down, reuse):
    """One placement's records both ways in one call equal the three copies it replaces
    (victims gathered, rows up, victims written down), where the rows coming up take the
    victims' device slots and (``reuse``) the victims take the rows' host slots."""
    from hiermem.dataplane import kernels as K

    rng = np.random.default_rng(seed)
    D, H, W = 48, 200, 12
    n_down = min(n_down, n_up) if reuse else n_down
    dev = rng.standard_normal((D, W)).astype(np.float32)
    host = rng.standard_normal((H, W)).astype(np.float32)
    dslots = rng.permutation(D)
    hslots = rng.permutation(H)
    dn_src, up_dst = dslots[:n_down], np.concatenate([dslots[:min(n_up, n_down)], dslots[D - max(0, n_up - n_down):]])
    up_src = hslots[:n_up]
    dn_dst = up_src[:n_down] if reuse else hslots[n_up:n_up + n_down]
    want_dev, want_host = dev.copy(), host.copy()
    down = want_dev[dn_src].copy()
    want_dev[up_dst] = want_host[up_src]
    want_host[dn_dst] = down
    plane = CompiledPlane()
    tdev = torch.from_numpy(dev)

    class Uniform:  # the host tier's view the plane reads: one record width
        def kernel_arrays(self):
            return host, None

    assert plane.swap_rows(tdev, Uniform(), *(a.astype(np.int64) for a in (dn_src, dn_dst, up_src, up_dst))) \
        == (n_up > 0 and n_down > 0)
    if n_up and n_down:
        np.testing.assert_array_equal(dev, want_dev)
        np.testing.assert_array_equal(host, want_host)
    assert not TorchPlane().swap_rows(tdev, Uniform(), dn_src, dn_dst, up_src, up_dst)  # the torch plane copies itself
