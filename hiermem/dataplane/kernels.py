"""The CPU data plane's compiled kernels: pooled lookup and the fused backward-optimizer.

Every kernel works straight on the tiers' record storage: the device tier's ``dev``
(float32 ``[capacity, width]``, C-contiguous) and the host tier's ``host``, whose records
are at each table's own width (:class:`~hiermem.tiers.HostTier`): with several widths
``host`` is a float-stride view of its storage (``host[o, c]`` is its ``o + c``-th
float) and host slot ``s``'s record starts at row ``hoff[s]``; with one width (the
common case) ``host`` is the tier's ``[H, W]`` array and ``hoff`` is None (no load per
id: measured, a ``hoff`` load per id cost the lookup 30-50%).  A row of the batch is
named by its *global* slot ``g`` (``g < cap``: ``dev[g]``, else ``host[hoff[g - cap]]``
or ``host[g - cap]``).  The two host layouts are two compiled copies of each kernel
(the mixed-width one compiles at the first mixed-width batch, then is cached).
No ``[n, dim]`` (per id) nor ``[U, dim]`` (per distinct row) intermediate is formed:
the lookup pools each bag into its output row, and the backward sums each distinct
row's gradient in a ``dim``-float buffer and applies the optimizer to the record in
place.  ``numba.njit(parallel=True, cache=True, nogil=True)``: the pooled lookup runs
in parallel over chunks of bags, the backward over tasks of distinct rows (each row is
written by one thread only: no atomics, no races); the caller sets numba's thread count.

How they are written (each measured on ``bench_store``/``bench_train`` batches, see
docs/dataplane.md): rows are added eight columns at a time into an accumulator on the
stack (:mod:`~hiermem.dataplane.simd`; numba's own loops compiled to one scalar add and
store per column); tier rows are indexed ``dev[g, c]``, never taken as views (a view per
id is a reference-count round trip); the row of the id (distinct row) ``AHEAD`` places
on is prefetched; and two common row widths (16, 64) have their own compiled copy,
where the width is a constant and the accumulator lives in registers (each copy costs
~4 s of first-import compile per kernel: 32 and 128 run the generic vector path).

Summation order (the torch reference path, :class:`~hiermem.dataplane.TorchPlane`,
adds in the same order): a bag's rows in input order; a distinct row's gradient over
its occurrences in input order (the stable sort of the dedup).  Arithmetic is float32
throughout, as the reference's; the one difference is that torch's vectorised kernels
may fuse a multiply and an add (one rounding instead of two), a difference of at most
one float32 ulp per operation.

Argument conventions (shared by the optimizer kernels):

* ``dev, host``: float32 ``[C, W]``; ``host`` float32 ``[H, W]`` C-contiguous (records
  of one width) or ``[*, W]`` (the host's float-stride view, mixed widths);
  ``hoff``: int64 ``[H]`` each host slot's record's row of ``host``, or None (one
  width: slot ``s`` at row ``s``); ``cap``: C (int64);
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

from .simd import V, add8, addmul8, axpy8, mov8, movmul8, prefetch_item, prefetch_row, stack_f32

def parallel(fn):
    """A data-plane kernel: parallel, cached on disk, releasing the GIL."""
    return numba.njit(cache=True, nogil=True, parallel=True)(fn)


def serial(fn):
    """A helper of the kernels (compiled into them)."""
    return numba.njit(cache=True, nogil=True, inline="always")(fn)


#: floats of the kernels' stack accumulator (wider rows take a heap one)
ACC = 1024
#: how many ids (lookup) or distinct rows (backward) ahead a row is prefetched.  16,
#: measured on the 2-core EPYC (``scripts/bench_pipeline.py``'s host-backed step, the
#: kernels timed inside a run, distances interleaved in one process): the lookup 0.073 ->
#: 0.064 ms and the fused SGD 0.097 -> 0.091 ms a step against 8, the device tier there
#: in L3; alone on random rows, 16 and 8 cost the same from DRAM (1M x 16 and 250k x 64
#: floats) and 32 or more costs up to 1.5x (more misses in flight than the core tracks).
AHEAD = 16


@serial
def scratch(cols):
    """A float32 accumulator of at least ``cols`` floats (on the stack up to ``ACC``)."""
    return stack_f32(ACC) if cols <= ACC else np.empty(cols, dtype=np.float32)


@serial
def hrow(host, hoff, cap, g):
    """The row of ``host`` where global slot ``g``'s record starts: ``hoff[g - cap]``, or
    with ``hoff`` None (every record one width, ``host`` the tier's ``[H, W]`` array)
    ``g - cap``.  A None ``hoff`` is a type of its own: numba prunes the offset path from
    that specialisation (half the compile time of a kernel carrying both)."""
    if hoff is None:
        return g - cap
    return hoff[g - cap]


@serial
def prefetch_slot(dev, host, hoff, cap, g, nbytes):
    """Prefetch the first ``nbytes`` of global slot ``g``'s record."""
    if g < cap:
        prefetch_row(dev, g, nbytes)
    else:
        prefetch_row(host, hrow(host, hoff, cap, g), nbytes)


@serial
def add_row(acc, src, r, cols, weighted, w):
    """``acc[:cols] += src[r, :cols] (* w)``, eight columns at a time."""
    cv = cols - cols % V
    if weighted:
        for c in range(0, cv, V):
            addmul8(acc, c, src, r, c, w)
        for c in range(cv, cols):
            acc[c] += src[r, c] * w
    else:
        for c in range(0, cv, V):
            add8(acc, c, src, r, c)
        for c in range(cv, cols):
            acc[c] += src[r, c]


#: row widths the kernels are specialised for: with the width a constant, LLVM keeps
#: the accumulator in vector registers across a bag's (a row's) ids instead of storing
#: and reloading it per id (a dependency chain through memory); other widths run the
#: same code with the width a variable.
W16, W64 = 16, 64
#: bags (lookup) per parallel chunk
BAG_CHUNK = 64


@serial
def pool_bags(dev, host, hoff, cap, gslot, inverse, offsets, n, scale, mean, out, lo, hi, cols, samples):
    """Bags ``lo:hi`` of :func:`pool` (``cols`` a constant in the specialised callers)."""
    nb = out.shape[0]
    per = nb // samples
    weighted = scale.size > 0
    nbytes = cols * 4
    acc = scratch(cols)
    for b in range(lo, hi):
        s = offsets[b]
        e = offsets[b + 1] if b + 1 < nb else n
        for c in range(cols):
            acc[c] = np.float32(0.0)
        for j in range(s, e):
            if j + AHEAD < n:
                prefetch_slot(dev, host, hoff, cap, gslot[inverse[j + AHEAD]], nbytes)
            g = gslot[inverse[j]]
            w = scale[j] if weighted else np.float32(1.0)
            if g < cap:
                add_row(acc, dev, g, cols, weighted, w)
            else:
                add_row(acc, host, hrow(host, hoff, cap, g), cols, weighted, w)
        if mean and e > s:
            ln = np.float32(e - s)
            for c in range(cols):
                acc[c] /= ln
        r = (b % samples) * per + b // samples
        for c in range(cols):
            out[r, c] = acc[c]


@parallel
def pool(dev, host, hoff, cap, gslot, inverse, offsets, n, scale, mean, out, samples):
    """Pooled rows: ``out[b, :cols] = sum_j rec(gslot[inverse[j]])[:cols] * scale[j]`` over
    bag ``b``'s positions (``/ len`` when ``mean``; an empty bag pools to zeros).

    ``inverse``: int64 ``[n]`` each position's distinct row; ``offsets``: int64 ``[B]``;
    ``out``: float32 ``[B, cols]``, C-contiguous, ``cols <= W``; ``samples``: ``B``, or
    the samples ``S`` of bags that are ``B / S`` tables of ``S`` samples each (table-major,
    as a collection's): bag ``b`` then goes to row ``(b % S) * (B / S) + b // S``, so
    ``out`` viewed as ``[S, (B / S) * cols]`` holds a sample's tables side by side.
    """
    nb, cols = out.shape
    for ch in prange((nb + BAG_CHUNK - 1) // BAG_CHUNK):
        lo = ch * BAG_CHUNK
        hi = min(nb, lo + BAG_CHUNK)
        if cols == W16:
            pool_bags(dev, host, hoff, cap, gslot, inverse, offsets, n, scale, mean, out, lo, hi, W16, samples)
        elif cols == W64:
            pool_bags(dev, host, hoff, cap, gslot, inverse, offsets, n, scale, mean, out, lo, hi, W64, samples)
        else:
            pool_bags(dev, host, hoff, cap, gslot, inverse, offsets, n, scale, mean, out, lo, hi, cols, samples)


@serial
def row_grad(acc, dim, perm, q0, cnt, src, grad, scale):
    """``acc[:dim]`` = the sum over a distinct row's positions (``perm[q0:q0+cnt]``, in
    input order) of ``grad[src[j], :dim] * scale[j]``."""
    direct = src.size == 0
    weighted = scale.size > 0
    dv = dim - dim % V
    for q in range(q0, q0 + cnt):
        j = perm[q]
        r = j if direct else src[j]
        if weighted:
            w = scale[j]
            if q == q0:
                for c in range(0, dv, V):
                    movmul8(acc, c, grad, r, c, w)
                for c in range(dv, dim):
                    acc[c] = grad[r, c] * w
            else:
                for c in range(0, dv, V):
                    addmul8(acc, c, grad, r, c, w)
                for c in range(dv, dim):
                    acc[c] += grad[r, c] * w
        elif q == q0:
            for c in range(0, dv, V):
                mov8(acc, c, grad, r, c)
            for c in range(dv, dim):
                acc[c] = grad[r, c]
        else:
            for c in range(0, dv, V):
                add8(acc, c, grad, r, c)
            for c in range(dv, dim):
                acc[c] += grad[r, c]


@serial
def next_row(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, u, end, nbytes):
    """Prefetch the record (and dirty flag) of distinct row ``u + AHEAD`` (if ``< end``)."""
    if u + AHEAD < end:
        g = gslot[u + AHEAD]
        prefetch_slot(dev, host, hoff, cap, g, nbytes)
        if g < cap:
            prefetch_item(dev_dirty, g)
        else:
            prefetch_item(host_dirty, g - cap)


@serial
def sgd_row(rec, r, acc, dim, nlr):
    dv = dim - dim % V
    for c in range(0, dv, V):
        axpy8(rec, r, c, acc, c, nlr)
    for c in range(dv, dim):
        rec[r, c] += nlr * acc[c]


@serial
def uniform_dim(t, dims):
    """The dim of every table of the batch when they share one, else 0."""
    d = dims[t[0]] if t.size else 0
    for i in range(dims.size):
        if dims[i] != d:
            return 0
    return d


@serial
def sgd_rows(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, lo, hi, src, grad, scale,
             nlr, nbytes, wdim):
    """Distinct rows ``lo:hi`` of :func:`sgd`; ``wdim``: every row's dim (a constant in the
    specialised callers), or 0 (each row's table's)."""
    acc = scratch(grad.shape[1] if wdim == 0 else wdim)
    for u in range(lo, hi):
        next_row(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, u, hi, nbytes)
        dim = wdim if wdim > 0 else dims[t[u]]
        row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
        g = gslot[u]
        if g < cap:
            dev_dirty[g] = True
            sgd_row(dev, g, acc, dim, nlr)
        else:
            host_dirty[g - cap] = True
            sgd_row(host, hrow(host, hoff, cap, g), acc, dim, nlr)


@parallel
def sgd(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad, scale,
        coef, lr):
    """SGD in place: ``w -= lr * g`` (see the module docstring for the arguments)."""
    nlr = np.float32(-lr)
    nbytes = dev.shape[1] * 4
    wd = uniform_dim(t, dims)
    for task in prange(bounds.size - 1):
        lo, hi = bounds[task], bounds[task + 1]
        if wd == W16:
            sgd_rows(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, lo, hi, src, grad,
                     scale, nlr, nbytes, W16)
        elif wd == W64:
            sgd_rows(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, lo, hi, src, grad,
                     scale, nlr, nbytes, W64)
        else:
            sgd_rows(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, lo, hi, src, grad,
                     scale, nlr, nbytes, 0)


@serial
def adagrad_row(rec, r, acc, dim, nlr, e):
    for c in range(dim):
        gc = acc[c]
        a = rec[r, dim + c] + gc * gc
        rec[r, dim + c] = a
        rec[r, c] += nlr * (gc / (np.sqrt(a) + e))


@parallel
def adagrad(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad, scale,
            coef, lr, eps):
    """Adagrad in place: ``acc += g*g; w -= lr * g / (sqrt(acc) + eps)`` element-wise,
    ``acc`` at ``rec[dim:2*dim]``."""
    nlr, e = np.float32(-lr), np.float32(eps)
    nbytes = dev.shape[1] * 4
    for task in prange(bounds.size - 1):
        acc = scratch(grad.shape[1])
        for u in range(bounds[task], bounds[task + 1]):
            next_row(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, u, bounds[task + 1], nbytes)
            dim = dims[t[u]]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            g = gslot[u]
            if g < cap:
                dev_dirty[g] = True
                adagrad_row(dev, g, acc, dim, nlr, e)
            else:
                host_dirty[g - cap] = True
                adagrad_row(host, hrow(host, hoff, cap, g), acc, dim, nlr, e)


@serial
def rowwise_adagrad_row(rec, r, acc, dim, nlr, e):
    sq = np.float32(0.0)
    for c in range(dim):
        sq += acc[c] * acc[c]
    a = rec[r, dim] + sq / np.float32(dim)
    rec[r, dim] = a
    den = np.sqrt(a) + e
    for c in range(dim):
        rec[r, c] += nlr * (acc[c] / den)


@parallel
def rowwise_adagrad(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad,
                    scale, coef, lr, eps):
    """Row-wise Adagrad in place: ``acc += mean(g*g); w -= lr * g / (sqrt(acc) + eps)``,
    ``acc`` at ``rec[dim]``."""
    nlr, e = np.float32(-lr), np.float32(eps)
    nbytes = dev.shape[1] * 4
    for task in prange(bounds.size - 1):
        acc = scratch(grad.shape[1])
        for u in range(bounds[task], bounds[task + 1]):
            next_row(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, u, bounds[task + 1], nbytes)
            dim = dims[t[u]]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            g = gslot[u]
            if g < cap:
                dev_dirty[g] = True
                rowwise_adagrad_row(dev, g, acc, dim, nlr, e)
            else:
                host_dirty[g - cap] = True
                rowwise_adagrad_row(host, hrow(host, hoff, cap, g), acc, dim, nlr, e)


@serial
def adam_row(rec, r, acc, dim, ns, o1, o2, e):
    for c in range(dim):
        gc = acc[c]
        m = rec[r, dim + c]
        m += (gc - m) * o1
        rec[r, dim + c] = m
        v = rec[r, 2 * dim + c]
        v += (gc * gc - v) * o2
        rec[r, 2 * dim + c] = v
        rec[r, c] += ns * (m / (np.sqrt(v) + e))


@parallel
def adam(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad, scale,
         coef, beta1, beta2, eps):
    """Adam in place (``torch.optim.SparseAdam`` on the touched rows): ``m += (g - m)(1 - b1);
    v += (g*g - v)(1 - b2); w -= coef[t] * m / (sqrt(v) + eps)``, ``m`` at
    ``rec[dim:2*dim]``, ``v`` at ``rec[2*dim:3*dim]``; ``coef``: each table's
    ``lr * sqrt(1 - b2**step) / (1 - b1**step)``."""
    o1, o2, e = np.float32(1.0 - beta1), np.float32(1.0 - beta2), np.float32(eps)
    nbytes = dev.shape[1] * 4
    for task in prange(bounds.size - 1):
        acc = scratch(grad.shape[1])
        for u in range(bounds[task], bounds[task + 1]):
            next_row(dev, host, hoff, cap, dev_dirty, host_dirty, gslot, u, bounds[task + 1], nbytes)
            ti = t[u]
            dim = dims[ti]
            ns = -coef[ti]
            row_grad(acc, dim, perm, starts[u], counts[u], src, grad, scale)
            g = gslot[u]
            if g < cap:
                dev_dirty[g] = True
                adam_row(dev, g, acc, dim, ns, o1, o2, e)
            else:
                host_dirty[g - cap] = True
                adam_row(host, hrow(host, hoff, cap, g), acc, dim, ns, o1, o2, e)


@parallel
def rows_up(dev, host, hoff, hcls, cw, src, dst, ahead):
    """The host -> device copy of a placement, in one pass and no intermediate:
    ``dev[dst[i]] = record(host slot src[i])``, its first ``min(width, W)`` floats and
    zeros after (``W`` = ``dev``'s columns).  ``dev`` float32 ``[C, W]``; ``host`` the
    host tier's rows (``[H, W]``, or its float-stride view with ``hoff``); ``hoff``,
    ``hcls`` int64 ``[H]`` each slot's record row and width class (None, None: every
    record ``W`` wide at row ``s``); ``cw`` int64 ``[K]`` the classes' widths; ``src``,
    ``dst`` int64 ``[n]``; ``ahead``: prefetch the record this many rows ahead (0: none).
    The caller reads what ``dst`` overwrites first (the device victims going down)."""
    W = dev.shape[1]
    n = src.size
    for i in prange(n):
        if ahead and i + ahead < n:
            prefetch_row(host, hrow(host, hoff, 0, src[i + ahead]), W * 4)
        r = hrow(host, hoff, 0, src[i])
        d = dst[i]
        w = W
        if hcls is not None:
            c = hcls[src[i]]
            w = min(cw[c], W) if c >= 0 else 0
        for j in range(w):
            dev[d, j] = host[r, j]
        for j in range(w, W):
            dev[d, j] = np.float32(0.0)


@parallel
def swap_rows(dev, host, dn_src, dn_dst, up_src, up_dst, tmp, ahead):
    """The records of a CPU placement whose host tier has one record width, in one call
    and no torch op: device victims ``dev[dn_src[i]]`` down to ``host[dn_dst[i]]``, host
    rows ``host[up_src[i]]`` up to ``dev[up_dst[i]]``.  ``dev`` float32 ``[C, W]``,
    ``host`` float32 ``[H, W]``; index arrays int64; ``tmp`` float32 ``[>= nd, W]``;
    ``ahead``: prefetch the host record this many rows ahead (0: none).

    Three passes, each finished before the next starts: the victims gathered into
    ``tmp`` (rows coming up take their device slots), the rows up (their host slots may
    be the victims' destinations), the victims written down.  Against ``index_select``,
    ``rows_up`` and ``index_copy_`` (the form it replaces): no intermediate allocated,
    and the host tier's scattered writes in a compiled loop rather than torch's
    per-index path (3.2k cold rows of 64 bytes each way, a 1M-row host tier: 0.61-0.65 ->
    0.37-0.38 ms)."""
    W = dev.shape[1]
    nd = dn_src.size
    nu = up_src.size
    for i in prange(nd):
        copy_row(tmp, i, dev, dn_src[i])
    for i in prange(nu):
        if ahead and i + ahead < nu:
            prefetch_row(host, up_src[i + ahead], W * 4)  # the record read next
        copy_row(dev, up_dst[i], host, up_src[i])
    for i in prange(nd):
        if ahead and i + ahead < nd:
            prefetch_row(host, dn_dst[i + ahead], W * 4)  # the record written next
        copy_row(host, dn_dst[i], tmp, i)


@serial
def copy_row(dst, d, src, s):
    """``dst[d, :] = src[s, :C]``, ``C`` = ``dst``'s columns."""
    for j in range(dst.shape[1]):
        dst[d, j] = src[s, j]


@parallel
def max_abs(x, rows, cols, nt):
    """``(finite, max |x[:rows, :cols]|)`` of float32 ``x [>= rows, >= cols]``, in ``nt``
    parallel parts (a bound on the gradient sums: NaN/inf and overflow are refused before
    anything changes).

    On the bits: a float's magnitude bits (sign cleared) order as its ``|x|`` does, and
    NaN/inf are the patterns from ``0x7f800000`` up, so one integer max (which LLVM
    vectorises, unlike a float max that must keep NaN) gives both answers."""
    per = (rows + nt - 1) // nt
    best = np.zeros(nt, dtype=np.uint32)
    xb = x.view(np.uint32)
    whole = cols == x.shape[1]
    flat = xb.reshape(-1)  # (x is C-contiguous) whole rows: one flat pass, vectorised
    mask = np.uint32(0x7FFFFFFF)
    for i in prange(nt):
        m = np.uint32(0)
        lo, hi = i * per, min(rows, (i + 1) * per)
        # (loops over a slice's own size: LLVM vectorises those, not ranges with a start)
        if whole:
            v = flat[lo * cols:max(lo, hi) * cols]
            for k in range(v.size):
                m = max(m, v[k] & mask)
        else:
            for r in range(lo, hi):
                xr = xb[r][:cols]
                for c in range(xr.size):
                    m = max(m, xr[c] & mask)
        best[i] = m
    top = best[:1].copy()
    top[0] = best.max()
    if top[0] >= np.uint32(0x7F800000):
        return False, np.inf
    return True, float(top.view(np.float32)[0])
