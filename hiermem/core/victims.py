"""The tier's victim search: the ``n`` evictable slots with the smallest ``(key, slot)``.

A pass over the tier per evicting batch costs O(capacity) (a host tier of 16M rows:
about a second), so the search keeps a *reservoir* (exact, not sampled):

* a sorted **run** ``(run_k, run_s)`` of the slots whose keys were at most ``tau`` when
  it was built (about 1/8 of the tier), walked from ``pos``;
* a min-**heap** ``(heap_k, heap_s)`` of every key set at or below ``tau`` since (carried
  old keys, LFU's fresh counts), so keys that arrive out of order cost ``O(log n)``.

Invariant: every occupied slot whose key is ``<= tau`` has an entry (run or heap) with its
current key.  Entries whose key is no longer the slot's are stale and skipped; the
victims are the smallest current entries that are evictable, merged from the run and
the heap.  When both run out (or the heap overflows) the reservoir is rebuilt by one
pass.  A one-access batch (a per-access trace) costs amortised O(1) for LRU and
O(log n) for LFU.  A tier of fewer slots than the run's floor keeps all of them in the
run (``tau`` its largest key) rather than sorting the tier for every miss, unless one
call takes at least 1/64 of its rows (a batch's victims: then one pass is as cheap).

``pol`` is the policy state tuple ``(key, score, uses, params, rm, run_s, run_k,
hk, hs, sk, ss)`` (the helpers take its arrays one by one, see :mod:`hiermem.core.jit`); ``rmeta`` (int64 ``[8]``): valid, tau, pos, run
length, heap length, builds, scans, and 1 to always scan (a reference for tests).  Evictable = occupied (``keys_t >= 0``), unpinned,
``mark == 0`` (the caller marks the batch's own slots).
"""

from __future__ import annotations

import numpy as np
from numba.core import types

from .jit import DISABLED, helper, inline, is_warm, kernel, leaf, prefetch, tiny
from . import queues as _q
from .names import FIRST_QUEUE as _FIRST_QUEUE

from .names import (RM_BUILDS as _BUILDS, RM_HLEN as _HLEN, RM_POS as _POS, RM_RLEN as _RLEN,
                    RM_SCAN_ONLY as SCAN_ONLY, RM_SCANS as _SCANS, RM_TAU as _TAU, RM_VALID as _VALID)
from .names import (LOOKAHEAD as _LOOKAHEAD, LRU as _LRU, PARAM_CODE, P_HEAP_K, P_HEAP_S, P_KEY, P_RM, P_RUN_K,
                    P_RUN_S, RM_ALL)
FRACTION = 8  # a build keeps about this fraction of the occupied slots
_AHEAD = 16  # run entries ahead whose slot record the walk prefetches
INT64_MAX = np.iinfo(np.int64).max


def new_state(capacity: int) -> np.ndarray:
    """``rmeta`` of an empty victim search (no reservoir yet), with room for the
    admission filter's fields (:mod:`hiermem.core.admission`)."""
    return np.zeros(RM_ALL, dtype=np.int64)


def heap_capacity(capacity: int) -> int:
    return max(1 << 16, capacity // 4)


@tiny
def drop(rm):
    """Forget the reservoir (the next search rebuilds it)."""
    rm[_VALID] = 0
    rm[_HLEN] = 0


@tiny
def _less(k1, s1, k2, s2):
    return k1 < k2 or (k1 == k2 and s1 < s2)


@leaf
def _push(hk, hs, n, k, s):
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if _less(k, s, hk[p], hs[p]):
            hk[i] = hk[p]
            hs[i] = hs[p]
            i = p
        else:
            break
    hk[i] = k
    hs[i] = s


@leaf
def _pop(hk, hs, n):
    """Remove the top of a heap of ``n`` entries (``n >= 1``)."""
    n -= 1
    k, s = hk[n], hs[n]
    i = np.int64(0)
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(hk[c + 1], hs[c + 1], hk[c], hs[c]):
            c += 1
        if _less(hk[c], hs[c], k, s):
            hk[i] = hk[c]
            hs[i] = hs[c]
            i = c
        else:
            break
    if n > 0:
        hk[i] = k
        hs[i] = s


@tiny
def set_key(key, rm, hk, hs, s, k):
    """``key[s] = k``, keeping the reservoir's invariant."""
    key[s] = k
    if rm[_VALID] and k <= rm[_TAU]:
        n = rm[_HLEN]
        if n >= hk.size:  # no evictions for long: let it go
            drop(rm)
        else:
            _push(hk, hs, n, k, s)
            rm[_HLEN] = n + 1


@tiny
def _median3(a, b, c):
    if a < b:
        return b if b < c else (c if a < c else a)
    return a if a < c else (c if b < c else b)


@tiny
def _sift_down(a, lo, i, m):
    """Restore the max-heap ``a[lo:lo + m]`` below its entry ``i`` (0-based in the heap)."""
    v = a[lo + i]
    while True:
        c = 2 * i + 1
        if c >= m:
            break
        if c + 1 < m and a[lo + c + 1] > a[lo + c]:
            c += 1
        if a[lo + c] > v:
            a[lo + i] = a[lo + c]
            i = c
        else:
            break
    a[lo + i] = v


@leaf
def _heap_select(a, lo, hi, k):
    """The ``k``-th smallest of ``a[lo:hi + 1]`` (``lo <= k <= hi``) in O(n log n), in
    place: a max-heap of the ``k - lo + 1`` smallest seen, built over ``a[lo:]``."""
    m = k - lo + 1
    for i in range(m // 2 - 1, -1, -1):
        _sift_down(a, lo, i, m)
    for x in range(lo + m, hi + 1):
        if a[x] < a[lo]:
            a[lo], a[x] = a[x], a[lo]
            _sift_down(a, lo, 0, m)
    return a[lo]


@leaf
def _select(a, n, k):
    """The ``k``-th smallest of ``a[:n]`` (0-based), permuting ``a`` in place: a
    quickselect (Hoare partition), O(n) expected on any keys, O(n log n) at worst.
    Written out instead of ``np.partition``, whose compiled form took ten seconds of
    the first import.

    The pivot is the median of three entries at pseudo-random places (a fixed-seed
    xorshift: the result does not depend on it, only the time does).  Median of the
    first, middle and last entry went quadratic on the keys an LRU tier holds in slot
    order, a rotated ascending run: a rebuild of a 50k-slot tier's reservoir took 39 ms
    instead of 0.3 (most of a per-access replay's time).  Past ``2 log2 n`` rounds the
    rest is a heap selection, so no order of keys can make it quadratic."""
    lo, hi = 0, n - 1
    x = np.uint64(0x9E3779B97F4A7C15)
    budget = np.int64(8)
    m = n
    while m > 1:
        budget += 2
        m >>= 1
    while lo < hi:
        budget -= 1
        if budget < 0:
            return _heap_select(a, lo, hi, k)
        w = np.uint64(hi - lo + 1)
        x ^= x << np.uint64(13)
        x ^= x >> np.uint64(7)
        x ^= x << np.uint64(17)
        p = _median3(a[lo + np.int64(x % w)], a[lo + np.int64((x >> np.uint64(21)) % w)],
                     a[lo + np.int64((x >> np.uint64(42)) % w)])
        i, j = lo, hi
        while i <= j:
            while a[i] < p:
                i += 1
            while a[j] > p:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:
            return a[k]
    return a[k]


@helper
def _sort_pairs(ks, ss, n):
    """Sort ``ks[:n]`` (int64) ascending, ``ss[:n]`` along with it, stably: an LSD radix
    sort of 8-bit digits, skipping the digits every key shares (a clock's top bytes: found
    by one pass that ORs each key's difference from the first, not a count per digit).
    Entries collected in slot order come out in ``(key, slot)`` order.  numba's stable
    ``argsort`` took ~10 ms for 50k keys, most of an evicting batch's placement."""
    if n < 2:
        return
    tk = np.empty(n, dtype=np.int64)
    ts = np.empty(n, dtype=np.int64)
    cnt = np.empty(256, dtype=np.int64)
    sign = np.uint64(0x8000000000000000)
    k0 = np.uint64(ks[0])
    varies = np.uint64(0)  # the bits in which some key differs from the first
    for i in range(n):
        varies |= np.uint64(ks[i]) ^ k0
    src_k, src_s, dst_k, dst_s = ks, ss, tk, ts
    moved = False
    for shift in range(0, 64, 8):
        sh = np.uint64(shift)
        if (varies >> sh) & np.uint64(255) == 0:  # one digit for all: this pass would not move anything
            continue
        cnt[:] = 0
        for i in range(n):
            cnt[np.int64(((np.uint64(src_k[i]) ^ sign) >> sh) & np.uint64(255))] += 1
        tot = np.int64(0)
        for d in range(256):
            c = cnt[d]
            cnt[d] = tot
            tot += c
        for i in range(n):
            d = np.int64(((np.uint64(src_k[i]) ^ sign) >> sh) & np.uint64(255))
            p = cnt[d]
            dst_k[p] = src_k[i]
            dst_s[p] = src_s[i]
            cnt[d] = p + 1
        src_k, src_s, dst_k, dst_s = dst_k, dst_s, src_k, src_s
        moved = not moved
    if moved:  # the sorted keys are in the scratch arrays
        for i in range(n):
            ks[i] = tk[i]
            ss[i] = ts[i]


_BUCKET_BITS = 12  # a key histogram has at most 2**12 buckets over the key range


@helper
def _nth_smallest(ks, m, kmin, kmax, n):
    """The ``n``-th smallest (1-based) of keys ``ks[:m]`` (all in ``[kmin, kmax]``;
    ``ks`` is left as it is).  A histogram of at most ``2**_BUCKET_BITS`` buckets over the
    key range finds the bucket holding it; that bucket's keys are the next round's, over
    their own range, until one key is left or few enough for a quickselect.  Each round
    narrows the range 2**11-fold or more, so skewed keys (LFU's: most in one count)
    cost a round more, never a pass per key; LRU's clocks are usually done in one."""
    buf = np.empty(m, dtype=np.int64)
    cur = ks
    lo_k, hi_k = kmin, kmax
    while True:
        if lo_k == hi_k:
            return lo_k
        if m <= 64:
            if cur is ks:
                buf[:m] = ks[:m]
            return _select(buf, m, n - 1)
        lo = np.uint64(np.int64(lo_k))  # (through int64: interpreted, a negative Python int would not convert)
        span = np.uint64(np.int64(hi_k)) - lo  # exact in uint64 for any two int64 keys
        shift = np.uint64(0)
        while (span >> shift) >> np.uint64(_BUCKET_BITS) != np.uint64(0):
            shift += np.uint64(1)
        cnt = np.zeros(np.int64(span >> shift) + 1, dtype=np.int64)
        for i in range(m):
            cnt[np.int64((np.uint64(cur[i]) - lo) >> shift)] += 1
        last = np.int64(0)
        while cnt[last] < n:
            n -= cnt[last]
            last += 1
        j = np.int64(0)
        lo_k, hi_k = INT64_MAX, -INT64_MAX - 1
        for i in range(m):  # in place when cur is buf: j never passes i
            k = cur[i]
            if np.int64((np.uint64(k) - lo) >> shift) == last:
                buf[j] = k
                lo_k = min(lo_k, k)
                hi_k = max(hi_k, k)
                j += 1
        cur = buf
        m = j


@helper
def _count(keys_t, pins, mark):
    """Occupied slots (unpinned and unmarked ones only, unless ``pins`` is None)."""
    m = np.int64(0)
    for s in range(keys_t.size):
        if keys_t[s] >= 0 and (pins is None or (pins[s] == 0 and mark[s] == 0)):
            m += 1
    return m


@helper
def _keep_upto(ks, ss, m, tau):
    """Keep the entries of ``ks[:m]``/``ss[:m]`` whose key is at most ``tau``, in their
    order, at the front; returns how many."""
    j = np.int64(0)
    for i in range(m):
        if ks[i] <= tau:
            ks[j] = ks[i]
            ss[j] = ss[i]
            j += 1
    return j


@helper
def _collect(key, keys_t, pins, mark, ks, ss):
    """The occupied slots (unpinned and unmarked ones only, unless ``pins`` is None) in
    slot order into ``ks``/``ss`` (keys, slots); returns ``(count, smallest key,
    largest key)``."""
    j = np.int64(0)
    kmin, kmax = INT64_MAX, -INT64_MAX - 1
    for s in range(keys_t.size):
        if keys_t[s] >= 0 and (pins is None or (pins[s] == 0 and mark[s] == 0)):
            k = key[s]
            ks[j] = k
            ss[j] = s
            kmin = min(kmin, k)
            kmax = max(kmax, k)
            j += 1
    return j, kmin, kmax


@helper
def build_(key, rm, run_s, run_k, keys_t, r):
    """A reservoir of the ``r`` occupied slots of smallest key (and all their ties): the
    threshold from :func:`_nth_smallest`, the entries up to it kept from the collected
    keys (no second pass over the tier), then sorted."""
    occ = _count(keys_t, None, None)
    ks = np.empty(occ, dtype=np.int64)
    ss = np.empty(occ, dtype=np.int64)
    occ, kmin, kmax = _collect(key, keys_t, None, None, ks, ss)
    if r >= occ:  # every occupied slot: keys set later above the largest need no entry
        tau = kmax if occ else np.int64(-INT64_MAX - 1)
    else:
        tau = _nth_smallest(ks, occ, kmin, kmax, r)
        occ = _keep_upto(ks, ss, occ, tau)
    _sort_pairs(ks, ss, occ)  # collected with slots ascending: (key, slot) order
    for i in range(occ):
        run_k[i] = ks[i]
        run_s[i] = ss[i]
    rm[_RLEN] = occ
    rm[_POS] = 0
    rm[_HLEN] = 0
    rm[_TAU] = tau
    rm[_VALID] = 1
    rm[_BUILDS] += 1


@helper
def scan_(key, rm, keys_t, pins, mark, n, out):
    """Victims by a pass over the tier; returns how many were found (< n: too few).

    The evictable slots' keys are collected in slot order; when ``n`` is less than half
    of them, only the entries up to the ``n``-th smallest key (:func:`_nth_smallest`) are
    kept and sorted: the same ``n`` victims in the same ``(key, slot)`` order as a sort
    of all of them, for a third of the sort (a batch evicting a quarter of a 50k-slot
    device tier: 1.75 -> ~0.6 Mcycles)."""
    m = _count(keys_t, pins, mark)
    ks = np.empty(m, dtype=np.int64)
    ss = np.empty(m, dtype=np.int64)
    m, kmin, kmax = _collect(key, keys_t, pins, mark, ks, ss)
    got = min(n, m)
    if 2 * n < m:  # the entries up to the n-th smallest key (its ties too)
        m = _keep_upto(ks, ss, m, _nth_smallest(ks, m, kmin, kmax, n))
    _sort_pairs(ks, ss, m)  # collected with slots ascending: (key, slot) order
    for i in range(got):
        out[i] = ss[i]
    rm[_SCANS] += 1
    return got


@leaf
def _walk(key, rm, run_s, run_k, hk, hs, sk, ss, keys_t, pins, mark, n, out):
    """Victims from the reservoir, merged from the run and the heap; the number found."""
    found = np.int64(0)
    i = rm[_POS]
    rlen = rm[_RLEN]
    lead = True
    nside = np.int64(0)
    while found < n:
        while i < rlen:  # the next current, evictable run entry
            if i + _AHEAD < rlen:  # victims are the coldest slots: their records are not cached
                prefetch(keys_t, run_s[i + _AHEAD])
            s = run_s[i]
            if keys_t[s] >= 0 and key[s] == run_k[i]:
                lead = False
                if pins[s] == 0 and mark[s] == 0:
                    break
            elif lead:  # stale entries at the front are gone for good
                rm[_POS] = i + 1
            i += 1
        while rm[_HLEN] > 0:  # the heap's top, if current and evictable
            s = hs[0]
            k = hk[0]
            if keys_t[s] < 0 or key[s] != k:
                _pop(hk, hs, rm[_HLEN])
                rm[_HLEN] -= 1
            elif pins[s] != 0 or mark[s] != 0:  # held: set aside, pushed back below
                sk[nside] = k
                ss[nside] = s
                nside += 1
                _pop(hk, hs, rm[_HLEN])
                rm[_HLEN] -= 1
            else:
                break
        has_run, has_heap = i < rlen, rm[_HLEN] > 0
        if not has_run and not has_heap:
            break
        if has_run and (not has_heap or _less(run_k[i], run_s[i], hk[0], hs[0])):
            s = run_s[i]
            i += 1
        else:
            s = hs[0]
            _pop(hk, hs, rm[_HLEN])
            rm[_HLEN] -= 1
        out[found] = s
        mark[s] = 2  # taken: a duplicate entry of the same slot is not taken twice
        found += 1
    for j in range(found):
        mark[out[j]] = 0
    for j in range(nside):
        _push(hk, hs, rm[_HLEN], sk[j], ss[j])
        rm[_HLEN] += 1
    return found


@inline
def victims_(key, score, uses, params, rm, run_s, run_k, hk, hs, sk, ss, keys_t, pins, mark, n, evictable, occupancy,
             out):
    """``out[:n]`` = the ``n`` evictable slots with the smallest ``(key, slot)``, in that
    order; ``evictable`` of ``occupancy`` occupied slots are.  Returns the number found
    (``n``, or fewer when fewer are evictable).  ``out``: int64 ``[>= n]``."""
    if n <= 0:
        return 0
    if np.int64(params[PARAM_CODE]) >= _FIRST_QUEUE:  # a queue policy: its lists decide
        return _q.victims(params, score, uses, rm, hk, hs, keys_t, pins, mark, n, out)
    if evictable < n:
        return scan_(key, rm, keys_t, pins, mark, n, out)
    held = occupancy - evictable
    r = max(8 * n, occupancy // FRACTION, 4096) + held
    if n == 1 and np.int64(params[PARAM_CODE]) == _LRU:  # one victim a call (a per-access trace)
        r = occupancy  # keys only grow: the whole tier, sorted once, lasts until it is spent
    if np.int64(params[PARAM_CODE]) == _LOOKAHEAD or rm[SCAN_ONLY] or (r >= occupancy and 64 * n >= occupancy):
        # lookahead rewrites every key; a small tier losing a large share of its rows at
        # once: one pass costs what a whole-tier reservoir would, without its heap
        drop(rm)
        return scan_(key, rm, keys_t, pins, mark, n, out)
    for _attempt in range(2):
        if rm[_VALID] == 0:
            build_(key, rm, run_s, run_k, keys_t, r)
        got = _walk(key, rm, run_s, run_k, hk, hs, sk, ss, keys_t, pins, mark, n, out)
        if got == n:
            return got
        drop(rm)
    return scan_(key, rm, keys_t, pins, mark, n, out)


@kernel
def victims(pol, keys_t, pins, mark, n, evictable, occupancy, out):
    """:func:`victims_` over a policy state tuple."""
    key, score, uses, params, rm, run_s, run_k, hk, hs, sk, ss = pol
    return victims_(key, score, uses, params, rm, run_s, run_k, hk, hs, sk, ss, keys_t, pins, mark, n, evictable,
                    occupancy, out)


@kernel
def scan(pol, keys_t, pins, mark, n, out):
    """:func:`scan_` over a policy state tuple."""
    return scan_(pol[P_KEY], pol[P_RM], keys_t, pins, mark, n, out)


@kernel
def check(pol, keys_t):
    """Whether the reservoir's invariant holds (a debugging aid; O(capacity))."""
    key, rm = pol[P_KEY], pol[P_RM]
    if rm[_VALID] == 0:
        return True
    have = np.zeros(keys_t.size, dtype=np.uint8)
    for i in range(rm[_POS], rm[_RLEN]):
        s = pol[P_RUN_S][i]
        if pol[P_RUN_K][i] == key[s]:
            have[s] = 1
    for i in range(rm[_HLEN]):
        s = pol[P_HEAP_S][i]
        if pol[P_HEAP_K][i] == key[s]:
            have[s] = 1
    for s in range(keys_t.size):
        if keys_t[s] >= 0 and key[s] <= rm[_TAU] and have[s] == 0:
            return False
    return True


if not DISABLED and not is_warm():
    # Compiled (with reference counting) at import, before any caller: the compiled
    # replay loop (a leaf, :func:`hiermem.core.jit.leaf`) reaches them through victims_,
    # and a leaf may call a function that allocates only through an existing overload.
    # With a warm cache the leaves load compiled, and these load lazily (0.5 s of import).
    # A tier's keys, tables, pins and marks are fields of its slot records: strided
    # views, layout "A" (hiermem.core.layout).
    _I64 = types.Array(types.int64, 1, "C")
    _FLD = types.Array(types.int64, 1, "A")
    build_.compile((_FLD, _I64, _I64, _I64, _FLD, types.int64))
    scan_.compile((_FLD, _I64, _FLD, types.Array(types.int32, 1, "A"), types.Array(types.uint8, 1, "A"),
                   types.int64, _I64))
