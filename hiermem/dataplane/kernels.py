"""The CPU data plane's compiled kernels: pooled lookup and the fused backward-optimizer.

Every kernel works straight on the tiers' record arrays (float32 ``[capacity, width]``,
C-contiguous): the device tier's ``dev`` and the host tier's ``host``, a row of the
batch named by its *global* slot ``g`` (``g < cap``: ``dev[g]``, else ``host[g - cap]``).
No ``[n, dim]`` (per id) nor ``[U, dim]`` (per distinct row) intermediate is formed:
the lookup pools each bag into its output row, and the backward sums each distinct
row's gradient in a ``dim``-float buffer and applies the optimizer to the record in
place.  ``numba.njit(parallel=True, cache=True, nogil=True)``: the pooled lookup runs
in parallel over bags, the backward over tasks of distinct rows (each row is written by
one thread only: no atomics, no races); the caller sets numba's thread count.

Summation order (the torch reference path, :class:`~hiermem.dataplane.TorchPlane`,
adds in the same order): a bag's rows in input order; a distinct row's gradient over
its occurrences in input order (the stable sort of the dedup).  Arithmetic is float32
throughout, as the reference's; the one difference is that torch's vectorised kernels
may fuse a multiply and an add (one rounding instead of two), a difference of at most
one float32 ulp per operation.

Argument conventions (shared by the optimizer kernels):

* ``dev, host``: float32 ``[C, W]`` and ``[H, W]``; ``cap``: C (int64);
* ``dev_dirty, host_dirty``: bool ``[C]`` / ``[H]``, set for every updated row;
* ``gslot``: int64 ``[U]`` global slot of each distinct row; ``t``: int64 ``[U]`` its
  table; ``dims``: int64 ``[T]`` each table's dim (its record is
  ``[weights (dim) | state]``);
* ``perm``: int64 ``[n]`` input positions in distinct-row order (stable); ``starts``,
  ``counts``: int64 ``[U]`` each distinct row's run in ``perm``;
* ``bounds``: int64 ``[tasks + 1]`` the distinct rows of each parallel task,
  ``bounds[i]:bounds[i+1]`` (tasks of about equal numbers of ids, not of rows: a hot
  row's many ids weigh as they cost);
* ``src``: int64 ``[n]`` the gradient row of each input position (its bag), or empty:
  position ``j`` reads ``grad[j]``; ``grad``: float32 ``[rows, >= max dim]``;
* ``scale``: float32 ``[n]`` per-position factor (per-sample weight, ``1/len`` for mean),
  or empty (1);
* ``coef``: float32 ``[T]`` a per-table factor (Adam's bias-corrected step size).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

def parallel(fn):
    """A data-plane kernel: parallel, cached on disk, releasing the GIL."""
    return numba.njit(cache=True, nogil=True, parallel=True)(fn)


def serial(fn):
    """A helper of the kernels (compiled into them)."""
    return numba.njit(cache=True, nogil=True, inline="always")(fn)


@parallel
def pool(dev, host, cap, gslot, inverse, offsets, n, scale, mean, out):
    """Pooled rows: ``out[b, :cols] = sum_j rec(gslot[inverse[j]])[:cols] * scale[j]`` over
    bag ``b``'s positions (``/ len`` when ``mean``; an empty bag pools to zeros).

    ``inverse``: int64 ``[n]`` each position's distinct row; ``offsets``: int64 ``[B]``;
    ``out``: float32 ``[B, cols]``, C-contiguous, ``cols <= W``.
    """
    nb, cols = out.shape
    weighted = scale.size > 0
    for b in prange(nb):
        s = offsets[b]
        e = offsets[b + 1] if b + 1 < nb else n
        o = out[b]
        for c in range(cols):
            o[c] = np.float32(0.0)
        for j in range(s, e):
            g = gslot[inverse[j]]
            row = dev[g] if g < cap else host[g - cap]
            if weighted:
                w = scale[j]
                for c in range(cols):
                    o[c] += row[c] * w
            else:
                for c in range(cols):
                    o[c] += row[c]
        if mean and e > s:
            ln = np.float32(e - s)
            for c in range(cols):
                o[c] /= ln


@serial
def row_grad(acc, dim, perm, q0, cnt, src, grad, scale):
    """``acc[:dim]`` = the sum over a distinct row's positions (``perm[q0:q0+cnt]``, in
    input order) of ``grad[src[j], :dim] * scale[j]``."""
    direct = src.size == 0
    weighted = scale.size > 0
    for q in range(q0, q0 + cnt):
        j = perm[q]
        r = j if direct else src[j]
        gr = grad[r]
        if weighted:
            w = scale[j]
            if q == q0:
                for c in range(dim):
                    acc[c] = gr[c] * w
            else:
                for c in range(dim):
                    acc[c] += gr[c] * w
        elif q == q0:
            for c in range(dim):
                acc[c] = gr[c]
        else:
            for c in range(dim):
                acc[c] += gr[c]


@serial
def record(dev, host, cap, dev_dirty, host_dirty, g):
    """The record of global slot ``g`` (a view), marked dirty."""
    if g < cap:
        dev_dirty[g] = True
        return dev[g]
    host_dirty[g - cap] = True
    return host[g - cap]


@parallel
def sgd(dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad, scale,
        coef, lr):
    """SGD in place: ``w -= lr * g`` (see the module docstring for the arguments)."""
    nlr = np.float32(-lr)
    for task in prange(bounds.size - 1):
        acc = np.empty(grad.shape[1], dtype=np.float32)
        for u in range(bounds[task], bounds[task + 1]):
            dim = dims[t[u]]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            rec = record(dev, host, cap, dev_dirty, host_dirty, gslot[u])
            for c in range(dim):
                rec[c] += nlr * acc[c]


@parallel
def adagrad(dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad, scale,
            coef, lr, eps):
    """Adagrad in place: ``acc += g*g; w -= lr * g / (sqrt(acc) + eps)`` element-wise,
    ``acc`` at ``rec[dim:2*dim]``."""
    nlr, e = np.float32(-lr), np.float32(eps)
    for task in prange(bounds.size - 1):
        acc = np.empty(grad.shape[1], dtype=np.float32)
        for u in range(bounds[task], bounds[task + 1]):
            dim = dims[t[u]]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            rec = record(dev, host, cap, dev_dirty, host_dirty, gslot[u])
            for c in range(dim):
                gc = acc[c]
                a = rec[dim + c] + gc * gc
                rec[dim + c] = a
                rec[c] += nlr * (gc / (np.sqrt(a) + e))


@parallel
def rowwise_adagrad(dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad,
                    scale, coef, lr, eps):
    """Row-wise Adagrad in place: ``acc += mean(g*g); w -= lr * g / (sqrt(acc) + eps)``,
    ``acc`` at ``rec[dim]``."""
    nlr, e = np.float32(-lr), np.float32(eps)
    for task in prange(bounds.size - 1):
        acc = np.empty(grad.shape[1], dtype=np.float32)
        for u in range(bounds[task], bounds[task + 1]):
            dim = dims[t[u]]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            rec = record(dev, host, cap, dev_dirty, host_dirty, gslot[u])
            sq = np.float32(0.0)
            for c in range(dim):
                sq += acc[c] * acc[c]
            a = rec[dim] + sq / np.float32(dim)
            rec[dim] = a
            den = np.sqrt(a) + e
            for c in range(dim):
                rec[c] += nlr * (acc[c] / den)


@parallel
def adam(dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad, scale,
         coef, beta1, beta2, eps):
    """Adam in place (``torch.optim.SparseAdam`` on the touched rows): ``m += (g - m)(1 - b1);
    v += (g*g - v)(1 - b2); w -= coef[t] * m / (sqrt(v) + eps)``, ``m`` at
    ``rec[dim:2*dim]``, ``v`` at ``rec[2*dim:3*dim]``; ``coef``: each table's
    ``lr * sqrt(1 - b2**step) / (1 - b1**step)``."""
    o1, o2, e = np.float32(1.0 - beta1), np.float32(1.0 - beta2), np.float32(eps)
    for task in prange(bounds.size - 1):
        acc = np.empty(grad.shape[1], dtype=np.float32)
        for u in range(bounds[task], bounds[task + 1]):
            ti = t[u]
            dim = dims[ti]
            ns = -coef[ti]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            rec = record(dev, host, cap, dev_dirty, host_dirty, gslot[u])
            for c in range(dim):
                gc = acc[c]
                m = rec[dim + c]
                m += (gc - m) * o1
                rec[dim + c] = m
                v = rec[2 * dim + c]
                v += (gc * gc - v) * o2
                rec[2 * dim + c] = v
                rec[c] += ns * (m / (np.sqrt(v) + e))


@parallel
def max_abs(x, rows, cols, nt):
    """``(finite, max |x[:rows, :cols]|)`` of float32 ``x [>= rows, >= cols]``, in ``nt``
    parallel parts (a bound on the gradient sums: NaN/inf and overflow are refused before
    anything changes)."""
    per = (rows + nt - 1) // nt
    best = np.zeros(nt, dtype=np.float64)
    bad = np.zeros(nt, dtype=np.bool_)
    for i in prange(nt):
        m = np.float32(0.0)
        z = np.float32(0.0)
        for r in range(i * per, min(rows, (i + 1) * per)):
            xr = x[r]
            for c in range(cols):
                a = abs(xr[c])
                z += a * np.float32(0.0)  # NaN once any a is NaN or inf
                m = max(m, a)
        best[i] = m
        bad[i] = z != z
    return not bad.any(), best.max()
