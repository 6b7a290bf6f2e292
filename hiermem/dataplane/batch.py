"""A batch's preparation on the CPU: validation, dedup, each id's bag, compiled.

The dedup is one stable radix sort and one pass over its runs.

``torch.sort(stable=True)`` plus the run bookkeeping (``nonzero``, ``cumsum``, a
scatter, gathers) is a chain of full passes over the batch, each a parallel region:
the largest part of a step on a small CPU.  Here the same outputs come from a serial
LSD radix sort (11-bit digits over the keys' actual span: two passes for 4M rows) and
one pass over the sorted keys.  Serial on purpose: a batch of ~100k keys sorts in well
under a millisecond, less than a parallel region's start on a loaded host.

The outputs equal those of a stable sort exactly (same order, same runs), so the
control plane sees the same batch whichever sorted it.  The validation and bag kernels
replace chains of torch reductions (``min``, ``max``, ``any`` over masks,
``repeat_interleave``) by one serial pass each, for the same reason.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

BITS = 11
RADIX = 1 << BITS


@numba.njit(cache=True, nogil=True)
def _passes(span):
    """Radix passes for keys in ``[0, span]`` (uint64)."""
    p = 0
    while span > 0:
        span >>= np.uint64(BITS)
        p += 1
    return p


@numba.njit(cache=True, nogil=True)
def sort_runs(x, t, off):
    """Stable sort of int64 keys and its runs of equal keys.

    The key of position ``i`` is ``x[i]`` (``t`` empty), the pair ``(t[i], x[i])``
    (``t`` int64 ``[n]``, ``off`` empty: lexicographic), or ``off[t[i]] + x[i]`` (``off``
    int64 ``[T]``: tables laid end to end in one id space).

    Returns ``(perm, starts, inverse, counts, lastpos, ux, ut)``, int64: ``perm [n]``
    input positions in sorted order (stable), and per run (distinct key, in sorted
    order) ``starts`` in ``perm``, ``counts``, ``lastpos`` (its last input position),
    its ``ux`` (``x``) and ``ut`` (``t``; empty when ``t`` is); ``inverse [n]`` each
    position's run.
    """
    n = x.size
    lex = t.size > 0 and off.size == 0
    perm = np.arange(n)
    key = np.empty(n, dtype=np.uint64)
    if n:
        if off.size:
            for i in range(n):
                key[i] = np.uint64(off[t[i]] + x[i])
        else:
            for i in range(n):
                key[i] = np.uint64(x[i])
        lo, hi = key.min(), key.max()
        for i in range(n):
            key[i] -= lo
        if not lex and hi - lo < np.uint64(2 * n + 1024):  # a span of the batch's size: count
            return _count_runs(x, t, key, np.int64(hi - lo) + 1)
        key, perm = _radix(key, perm, _passes(hi - lo))
        if lex:  # then by table, stably
            tlo, thi = t.min(), t.max()
            tk = np.empty(n, dtype=np.uint64)
            for i in range(n):
                tk[i] = np.uint64(t[perm[i]] - tlo)
            tk, perm = _radix(tk, perm, _passes(np.uint64(thi - tlo)))
            for i in range(n):
                key[i] = np.uint64(x[perm[i]])
    # runs of equal keys: the sorted keys in key (lexicographic: equal t too)
    starts = np.empty(n, dtype=np.int64)
    counts = np.empty(n, dtype=np.int64)
    lastpos = np.empty(n, dtype=np.int64)
    ux = np.empty(n, dtype=np.int64)
    ut = np.empty(n if t.size else 0, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    r = -1
    for i in range(n):
        j = perm[i]
        if i == 0 or key[i] != key[i - 1] or (lex and t[j] != t[perm[i - 1]]):
            r += 1
            starts[r] = i
            counts[r] = 0
            ux[r] = x[j]
            if t.size:
                ut[r] = t[j]
        counts[r] += 1
        lastpos[r] = j  # in a stable sort the last of a run is the key's last occurrence
        inverse[j] = r
    nr = r + 1
    return (perm, starts[:nr].copy(), inverse, counts[:nr].copy(), lastpos[:nr].copy(), ux[:nr].copy(),
            ut[:nr].copy())


@numba.njit(cache=True, nogil=True)
def _count_runs(x, t, key, span):
    """:func:`sort_runs` by counting, for keys ``key`` (uint64, ``[0, span)``, span about the
    batch's size or less): one pass to count, one over the span for the runs (the distinct
    keys in order), one stable scatter; the same outputs as the radix sort."""
    n = key.size
    nxt = np.zeros(span, dtype=np.int64)
    for i in range(n):
        nxt[key[i]] += 1
    rank = np.empty(span, dtype=np.int64)
    starts = np.empty(n, dtype=np.int64)
    counts = np.empty(n, dtype=np.int64)
    nr = 0
    pos = 0
    for v in range(span):
        c = nxt[v]
        if c:
            starts[nr] = pos
            counts[nr] = c
            rank[v] = nr
            nxt[v] = pos
            pos += c
            nr += 1
    perm = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    for i in range(n):  # stable: equal keys keep their input order
        v = key[i]
        q = nxt[v]
        nxt[v] = q + 1
        perm[q] = i
        inverse[i] = rank[v]
    lastpos = np.empty(nr, dtype=np.int64)
    ux = np.empty(nr, dtype=np.int64)
    ut = np.empty(nr if t.size else 0, dtype=np.int64)
    for r in range(nr):
        j = perm[starts[r]]
        ux[r] = x[j]
        if t.size:
            ut[r] = t[j]
        lastpos[r] = perm[starts[r] + counts[r] - 1]
    return perm, starts[:nr].copy(), inverse, counts[:nr].copy(), lastpos, ux, ut


@numba.njit(cache=True, nogil=True)
def _radix(key, perm, passes):
    """Stable LSD radix sort of uint64 ``key`` carrying int64 ``perm``: the sorted
    ``(key, perm)`` (the inputs, or new arrays; the inputs may change)."""
    n = key.size
    if passes == 0:
        return key, perm
    key2 = np.empty(n, dtype=np.uint64)
    perm2 = np.empty(n, dtype=np.int64)
    mask = np.uint64(RADIX - 1)
    hist = np.zeros((passes, RADIX), dtype=np.int64)
    for i in range(n):  # every pass's histogram in one read
        k = key[i]
        for p in range(passes):
            hist[p, (k >> np.uint64(BITS * p)) & mask] += 1
    for p in range(passes):
        shift = np.uint64(BITS * p)
        h = hist[p]
        s = 0
        for d in range(RADIX):
            c = h[d]
            h[d] = s
            s += c
        for i in range(n):
            k = key[i]
            q = h[(k >> shift) & mask]
            h[(k >> shift) & mask] = q + 1
            key2[q] = k
            perm2[q] = perm[i]
        key, key2 = key2, key
        perm, perm2 = perm2, perm
    return key, perm


_NONE = np.zeros(0, dtype=np.int64)


def sorted_runs(x: torch.Tensor, t: torch.Tensor | None = None,
                off: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`sort_runs` of CPU int64 tensors, as tensors sharing its arrays."""
    xn = x.contiguous().numpy()
    tn = _NONE if t is None else t.contiguous().numpy()
    return tuple(torch.from_numpy(a) for a in sort_runs(xn, tn, _NONE if off is None else off))


@numba.njit(cache=True, nogil=True)
def repeat(values, lengths, per):
    """``values[i]`` repeated ``sum(lengths[i*per:(i+1)*per])`` times, in order: int64
    ``values [K]``, ``lengths [K*per]`` (e.g. the table of every id of a keyed batch)."""
    n = 0
    for j in range(lengths.size):
        n += lengths[j]
    out = np.empty(n, dtype=np.int64)
    q = 0
    for i in range(values.size):
        m = 0
        for j in range(i * per, (i + 1) * per):
            m += lengths[j]
        for j in range(q, q + m):
            out[j] = values[i]
        q += m
    return out


@numba.njit(cache=True, nogil=True)
def minmax(x):
    """``(min, max)`` of int64 ``x [n]``, n >= 1."""
    lo = hi = x[0]
    for i in range(1, x.size):
        v = x[i]
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return lo, hi


@numba.njit(cache=True, nogil=True)
def first_bad(t, k, ntables, max_ids):
    """First position whose table ``t[j]`` is outside ``[0, ntables)`` (returned as
    ``(j, 0)``) or whose id ``k[j]`` is outside ``[0, max_ids[t[j]]]`` (``(j, 1)``), else
    ``(-1, -1)``; int64 ``t``, ``k [n]``, ``max_ids [ntables]``."""
    for j in range(k.size):
        ti = t[j]
        if ti < 0 or ti >= ntables:
            return j, 0
        if k[j] < 0 or k[j] > max_ids[ti]:
            return j, 1
    return -1, -1


@numba.njit(cache=True, nogil=True)
def bag_of(offsets, n, samples):
    """int64 ``[n]``: the bag of each position (bag ``b`` holds ``[offsets[b], offsets[b+1])``,
    the last one up to ``n``); with ``samples > 0``, when the ``B`` bags are ``B /
    samples`` tables of ``samples`` samples (table-major), its bag's row when the rows are
    sample-major instead: ``(b % samples) * (B / samples) + b // samples``."""
    out = np.empty(n, dtype=np.int64)
    nb = offsets.size
    s = samples if samples > 0 else max(nb, 1)  # (B samples of one table: the bag itself)
    per = nb // s
    for b in range(nb):
        e = offsets[b + 1] if b + 1 < nb else n
        r = (b % s) * per + b // s
        for j in range(offsets[b], e):
            out[j] = r
    return out


@numba.njit(cache=True, nogil=True)
def offsets_bad(offsets, n):
    """Whether int64 ``offsets [B]`` (B >= 1) fail to start at 0, decrease somewhere or
    pass ``n``: one pass instead of three torch reductions."""
    if offsets[0] != 0 or offsets[offsets.size - 1] > n:
        return True
    for b in range(1, offsets.size):
        if offsets[b] < offsets[b - 1]:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def tables_present(t, ntables):
    """Sorted distinct values of int64 ``t`` (table indices in ``[0, ntables)``)."""
    seen = np.zeros(ntables, dtype=np.bool_)
    for i in range(t.size):
        seen[t[i]] = True
    return np.flatnonzero(seen)
