"""Eviction policies as compiled kernels: a key per slot, victims are the smallest keys.

A policy is two things, both compiled (numba) and shared by the store and the simulator:

* **how accesses update the keys** (:func:`new_key`): a row inserted into a tier, or a
  resident row used ``count`` times with its last use at access ``clock``, gets a new
  int64 key; rows moving between tiers carry their key (and any extra per-slot state);
* **which slots go first**: the evictable slots with the smallest ``(key, slot)`` (ties
  to the lower slot).  The victim search itself (:mod:`hiermem.core.victims`) is the
  tier's, not the policy's.

Per-slot state lives in flat arrays: ``key`` (int64, the order; in a tier, a field of its
slot records, :mod:`hiermem.core.layout`), and for policies that need it ``score``
(float64) and ``uses`` (int64); ``params`` (float64 ``[4]``) holds the
policy's code and parameters.  Float orders (``lfu_decay``'s decayed counts) become int64
keys through an order-preserving bit map (:func:`f2key`), so every policy shares one
integer victim search.

The admission filter (:mod:`hiermem.core.admission`) works with every policy through
:func:`probation`: a refused row's key drops below every other (LRU and LFU keys by
``REFUSED_SHIFT``, lfu_decay's score by ``REFUSED_FLOOR``; a queue policy's row goes to
its ``Q_ADM`` list), and its next use computes its key as usual.

Adding a policy: give it a code below, a branch in :func:`new_key` (and
:func:`lookahead_keys` if it uses future ids), and a class in :mod:`hiermem.core.policies`
naming the code and its parameters; the contract suite runs it compiled and interpreted.
"""

from __future__ import annotations

import math

import numpy as np

from .jit import f64_bits, helper, kernel, tiny
from .names import LFU, LFU_DECAY, LOOKAHEAD, LRU  # noqa: F401  (the policy codes)
from .names import FIRST_QUEUE
from . import queues as _q
from .names import P_HEAP_K, P_HEAP_S, P_KEY, P_PARAMS, P_RM, PARAM_ADMIT, PARAM_BASE, PARAM_CODE, PARAM_HALF_LIFE
from .victims import drop, set_key

CLOCK_BITS = 40  # LFU keys pack (count, last clock) as count << 40 | clock
_CLOCK_MASK = (1 << CLOCK_BITS) - 1
_COUNT_MAX = (1 << 22) - 1
SOON = 1 << 62  # lookahead: rows the next batches use (evicted after all others)
NEXT_MAX = (1 << 21) - 1  # lookahead: next uses further ahead tie
PROBATION = float(2 ** 41)  # lfu_decay: below any log2 score reached
# rows the admission filter refused (hiermem.core.admission): below every other key
REFUSED_SHIFT = 1 << 62  # LRU / LFU keys (>= 0 otherwise): the key minus this
REFUSED_FLOOR = 4 * PROBATION  # lfu_decay: the score minus this (below lfu_decay's own probation)
_LN2 = 0.6931471805599453


@tiny
def f2key(x):
    """An int64 with the order of float64 ``x`` (no NaN)."""
    b = f64_bits(x)
    if b < 0:
        b = b ^ np.int64(0x7FFFFFFFFFFFFFFF)
    return b


@tiny
def _logaddexp2(a, b):
    """``log2(2**a + 2**b)``.  ``math``'s functions, not numpy's: compiled and interpreted
    they are the same libm calls, while numpy's SIMD ``log1p``/``log2`` (AVX-512 builds)
    and numba's ``**`` differ from libm in the last bit, and the parity test would see it."""
    m = max(a, b)
    return m + math.log1p(math.exp2(min(a, b) - m)) / _LN2


@tiny
def _key_of(kind, params, prev, score, uses, s, clock, count, insert):
    """The key of slot ``s`` under the key policy ``kind`` (LRU, LFU, LFU_DECAY) after an
    access; ``prev`` its key before (LFU reads its count there)."""
    if kind == LRU:
        return clock
    if kind == LFU:
        if prev < 0:  # a refused row (admitted now)
            prev += REFUSED_SHIFT
        c = count if insert else (prev >> CLOCK_BITS) + count
        return (min(c, _COUNT_MAX) << CLOCK_BITS) | (clock & _CLOCK_MASK)
    # LFU_DECAY: log2 of the sum of count * 2**(clock / half_life) over uses
    w = math.log2(np.float64(count)) + clock / params[PARAM_HALF_LIFE]
    if insert:
        score[s] = w
        uses[s] = count
    else:
        score[s] = _logaddexp2(score[s], w)
        uses[s] += count
    v = score[s] - PROBATION if uses[s] < params[PARAM_ADMIT] else score[s]
    return f2key(v)


@tiny
def new_key(params, key, score, uses, s, clock, count, insert):
    """The key of slot ``s`` after an access (``insert``: the row just entered the
    tiers) of ``count`` uses, the last at ``clock``; updates ``score``/``uses``."""
    kind = np.int64(params[PARAM_CODE])
    if kind == LOOKAHEAD:  # (touch keeps lookahead's base keys; this is its LRU form)
        return clock if insert else clock | (key[s] & SOON)
    return _key_of(kind, params, key[s], score, uses, s, clock, count, insert)


@tiny
def outside_key(base, b):
    """Lookahead's key of a row no batch in the window uses: its base key, below ``SOON``
    (lfu_decay's float-ordered keys shifted down two bits; LRU and LFU keys already are)."""
    return b >> 2 if base == LFU_DECAY else b


@tiny
def window_key(b, nxt):
    """Lookahead's key of a row next used ``nxt`` batches ahead (inside the window): above
    every base key, the furthest first, ties by the base key's low 40 bits (LRU's clock)."""
    return SOON | ((NEXT_MAX - min(nxt, NEXT_MAX)) << CLOCK_BITS) | (b & _CLOCK_MASK)


@tiny
def touch(key, score, uses, params, rm, hk, hs, s, clock, count, insert):
    """Apply :func:`new_key` to slot ``s`` through the victim search's bookkeeping (a
    queue policy's lists, :mod:`hiermem.core.queues`, instead)."""
    code = np.int64(params[PARAM_CODE])
    if code >= FIRST_QUEUE:
        _q.access(params, code, key, score, uses, rm, hk, hs, s, clock, count, insert)
    elif code == LOOKAHEAD:  # base keys in hk, next uses inside the window in hs (-1: none)
        base = np.int64(params[PARAM_BASE])
        b = _key_of(base, params, hk[s], score, uses, s, clock, count, insert)
        hk[s] = b
        if insert:
            hs[s] = -1
        key[s] = outside_key(base, b) if hs[s] < 0 else window_key(b, hs[s])
    else:
        set_key(key, rm, hk, hs, s, new_key(params, key, score, uses, s, clock, count, insert))


@tiny
def _refused(kind, k, sc):
    """The key under key policy ``kind`` of a row the admission filter refused, whose
    key is ``k`` and score ``sc``: below every admitted row's key, in the same order."""
    if kind == LFU_DECAY:
        return f2key(sc - REFUSED_FLOOR)
    return k - REFUSED_SHIFT if k >= 0 else k


@helper
def probation(params, key, score, uses, rm, hk, hs, s):
    """The admission filter refused the row that just entered slot ``s``: its key drops
    below every admitted row's (a queue policy's row goes to ``Q_ADM``), so it is the
    first victim, until its next use recomputes its key."""
    code = np.int64(params[PARAM_CODE])
    if code >= FIRST_QUEUE:
        _q.refuse(rm, hk, s)
    elif code == LOOKAHEAD:  # its base key; the window's order still comes first
        base = np.int64(params[PARAM_BASE])
        b = _refused(base, hk[s], score[s])
        hk[s] = b
        key[s] = outside_key(base, b) if hs[s] < 0 else window_key(b, hs[s])
    else:
        set_key(key, rm, hk, hs, s, _refused(code, key[s], score[s]))


@kernel
def access(pol, slots, clock, counts, insert):
    """:func:`touch` for a batch of slots: ``slots, clock, counts`` int64 ``[n]``."""
    key, score, uses, params, rm, _, _, hk, hs, _, _ = pol
    for i in range(slots.size):
        touch(key, score, uses, params, rm, hk, hs, slots[i], clock[i], counts[i], insert)


@kernel
def carry_in(pol, slots, key_in, score_in, uses_in):
    """Slots take carried state (``key, score, uses`` per slot, int64/float64/int64)."""
    key, score, uses, params, rm, _, _, hk, hs, _, _ = pol
    code = np.int64(params[PARAM_CODE])
    for i in range(slots.size):
        s = slots[i]
        score[s] = score_in[i]
        uses[s] = uses_in[i]
        set_key(key, rm, hk, hs, s, key_in[i])
    if code >= FIRST_QUEUE:  # the rows enter the queues oldest access first
        order = np.argsort(key_in, kind="mergesort")
        for i in range(order.size):
            _q.carry(params, code, score, uses, rm, hk, hs, slots[order[i]])


@kernel
def lookahead_keys(pol, slots, nxt):
    """The rows in ``slots`` are next used ``nxt`` batches ahead (inside the window; this
    set replaces the last): their keys become :func:`window_key`, every other slot's its
    base key.  Rewrites every key, so the victim search starts over."""
    key, hk, hs = pol[P_KEY], pol[P_HEAP_K], pol[P_HEAP_S]
    params = pol[P_PARAMS]
    if np.int64(params[PARAM_CODE]) != LOOKAHEAD:
        return
    base = np.int64(params[PARAM_BASE])
    for s in range(min(key.size, hk.size)):
        hs[s] = -1
        key[s] = outside_key(base, hk[s])
    for i in range(slots.size):
        s = slots[i]
        hs[s] = max(nxt[i], 0)
        key[s] = window_key(hk[s], hs[s])
    drop(pol[P_RM])


@kernel
def lookahead_carry(pol, slots, key_in):
    """Lookahead rows carried in with keys ``key_in``: their base keys (a window key's
    base is not kept: it becomes the oldest)."""
    key, hk, hs = pol[P_KEY], pol[P_HEAP_K], pol[P_HEAP_S]
    base = np.int64(pol[P_PARAMS][PARAM_BASE])
    for i in range(slots.size):
        s = slots[i]
        k = key_in[i]
        b = np.int64(0) if k >= SOON else (k << 2 if base == LFU_DECAY else k)
        hk[s] = b
        hs[s] = -1
        key[s] = outside_key(base, b)


def incremental(kind: int) -> bool:
    """Whether keys change only through :func:`set_key` (victims from the reservoir)."""
    return kind != LOOKAHEAD and kind < FIRST_QUEUE
