"""Queue policies: SIEVE, S3-FIFO, ARC and W-TinyLFU as compiled kernels over slot lists.

These algorithms do not order slots by one key: their victims come from the tail of a
FIFO or LRU queue, with second chances (a visited bit, a frequency) and *ghosts* (the
ids of rows evicted lately, whose return changes where a row goes).  Each tier's policy
keeps, beside the per-slot arrays every policy has:

* doubly linked lists over the slots, up to four queues (``hk``: newer, older and queue
  id per slot; heads, tails and sizes in ``rm`` past the victim search's fields,
  :mod:`hiermem.core.names`).  ``key`` holds the clock of each slot's last access;
  ``score`` the policy's per-slot count (SIEVE's visited bit, S3-FIFO's frequency);
  ``uses`` the row's 64-bit hash (:func:`rowhash`, set when the row enters from disk,
  carried between tiers) so ghosts and sketches know rows, not slots;
* ghosts: up to two FIFO lists of row hashes (rings in ``hs`` with lazy deletion, and an
  open-addressing hash table over them: O(1) insert, lookup, removal);
* W-TinyLFU's frequency sketch (a count-min sketch with minimal increment and halving,
  :mod:`hiermem.core.sketch`).

Queue ``Q_ADM`` (3, which no policy uses) holds the rows the admission filter refused
(:mod:`hiermem.core.admission`): they are the first victims, oldest first, and a row
used again there enters the policy's queues as a carried row would.

Slots freed by the placement's other paths (a host row promoted to the device, a flush)
leave their list node behind: a node whose slot is empty is unlinked when a victim walk
meets it, a reused slot's node when its new row enters.  The queue sizes count such
nodes until then, which only a host tier has (its rows also leave upward); the device
tier of a single-tier replay is exact.  Slots the victim search must not take (pinned,
or held by the batch) are walked past, in place.  A victim is unlinked when chosen
(``qid`` marked taken); were the batch's I/O to fail, the walk that next finds too few
victims relinks every occupied slot no list holds.

Semantics, per algorithm (``C`` the tier's slots), as libCacheSim 0.3.5 implements them
where the tests cross-check them per access:

* ``sieve``: one FIFO queue; a hit sets the visited bit; the hand walks from the tail
  toward newer rows, clearing visited bits, and evicts the first unvisited row; it stays
  where it stopped (wrapping to the tail).
* ``s3fifo``: small FIFO (``small`` x C), main FIFO (the rest), ghost FIFO of
  ``ghost`` x C row ids.  A miss in the ghost goes to main, else to small (to main while
  small is full before the first eviction, libCacheSim's variant).  Evict from main when
  it is over its size or small is empty: a row with frequency >= 1 is reinserted at
  main's head with ``min(freq, 3) - 1``; else from small: frequency >= ``threshold`` moves
  to main (frequency 0), else the row is evicted and its id enters the ghost.
* ``arc``: T1/T2 (LRU), ghosts B1/B2 and the target ``p`` as in Megiddo & Modha,
  libCacheSim's ARC.c order: a miss found in a ghost adapts ``p`` and evicts with
  REPLACE; other misses evict as its ``ARC_evict`` (cases A and B).  The placement knows
  a batch's misses before it picks victims (:func:`premiss`), so per access this is
  the same sequence; a batch of several misses adapts ``p`` for all before its victims.
* ``wtinylfu``: window LRU (``window`` x C), main SLRU as Caffeine's (rows enter
  probation, a hit there promotes to protected, which holds at most 4/5 of main and
  demotes its LRU row back to probation), a count-min sketch of 4 rows (minimal increment; every count halved after
  32 x main accesses that hit main, as libCacheSim counts).  When the cache is full the
  window's LRU row competes with main's victim: the one with the higher estimate stays.
  libCacheSim differs in two ways: a counting Bloom filter (other hashes, no collisions
  to speak of) and an SLRU that inserts into the lowest segment with room (during
  warm-up protected fills with rows never used twice); misses agree to within ~4%,
  either side (MovieLens 10%: +3.9%, Zipf 10%: -3.6%), not access by access.  (With a
  window below one row libCacheSim admits nothing; ours still caches.)
"""

from __future__ import annotations

import numpy as np

from . import sketch as _sk
from .jit import helper, kernel, tiny
from .sketch import rowhash
from .names import (ARC, FIRST_QUEUE, G_CAP, G_HI, G_LIVE, G_LO, G_RING, G_RSZ, G_TABLE, G_TH, G_USED, K_ADDS, K_OFF,
                    K_SAMPLE, K_W, PARAM_CODE, Q_ADM, Q_LA, Q_C, Q_EVICTED, Q_FLAG, Q_GONE, Q_HAND, Q_HEAD, Q_MAIN,
                    Q_NONE, Q_P, Q_PRE, Q_PROT, Q_RMSIZE, Q_SIZE, Q_SMALL, Q_TAIL, S3FIFO, SIEVE, WTINYLFU)

NQ = 4  # queues a tier can have (the last, Q_ADM, holds the rows the admission filter refused)


def is_queue(code: int) -> bool:
    return int(code) >= FIRST_QUEUE


def layout(code: int, capacity: int, params: dict) -> tuple[int, int]:
    """Sizes of ``hk`` and ``hs`` (int64) for a queue policy of ``capacity`` slots."""
    C = max(1, int(capacity))
    _, _, rsz, th = _ghost_layout(code, C, params)
    return 4 * C, 2 * rsz + 2 * th + 4 * sketch_width(code, C)


def _ghost_layout(code: int, C: int, params: dict) -> tuple[int, int, int, int]:
    """The ghosts' capacities, ring size and hash-table size (a power of two, at most
    half full)."""
    g0, g1 = ghost_caps(code, C, params)
    th = 64
    while th < 4 * (g0 + g1) + 64:
        th *= 2
    return g0, g1, 2 * max(g0, g1) + 64, th


def ghost_caps(code: int, C: int, params: dict) -> tuple[int, int]:
    if code == S3FIFO:  # list 1: misses the ghost held, taken out before the victims were picked
        return int(C * params["ghost"]), C + 1
    if code == ARC:
        return 2 * C + 1, 2 * C + 1  # ARC bounds its ghosts itself (|T1|+|B1| <= C, all <= 2C)
    return 0, 0


def sketch_width(code: int, C: int) -> int:
    return _sk.width(C, 16) if code == WTINYLFU else 0


def init_state(code: int, capacity: int, params: dict, rm: np.ndarray, hk: np.ndarray, hs: np.ndarray) -> None:
    """Empty queues, ghosts and sketch for a tier of ``capacity`` slots."""
    C = max(1, int(capacity))
    rm[Q_C] = C
    for q in range(NQ):
        rm[Q_HEAD + q] = -1
        rm[Q_TAIL + q] = -1
        rm[Q_SIZE + q] = 0
    rm[Q_HAND] = -1
    rm[Q_P] = 0
    rm[Q_FLAG] = rm[Q_PRE] = rm[Q_EVICTED] = 0
    if code == S3FIFO:
        rm[Q_SMALL] = int(C * params["small"])
        rm[Q_MAIN] = C - rm[Q_SMALL]
    elif code == WTINYLFU:
        rm[Q_SMALL] = int(C * params["window"])
        main = C - rm[Q_SMALL]
        rm[Q_MAIN] = main
        rm[Q_PROT] = int(4.0 / 5.0 * main)  # SLRU: protected holds at most 4/5 of main
    g0, g1, rsz, th = _ghost_layout(code, C, params)
    rm[G_CAP], rm[G_CAP + 1] = g0, g1
    rm[G_LO] = rm[G_LO + 1] = rm[G_HI] = rm[G_HI + 1] = 0
    rm[G_LIVE] = rm[G_LIVE + 1] = 0
    rm[G_RSZ], rm[G_TH], rm[G_USED] = rsz, th, 0
    rm[G_RING], rm[G_TABLE] = 0, 2 * rsz
    rm[K_OFF], rm[K_W] = 2 * rsz + 2 * th, sketch_width(code, C)
    rm[K_ADDS] = 0
    rm[K_SAMPLE] = 32 * max(1, int(rm[Q_MAIN]))
    hk[2 * C:3 * C] = Q_NONE
    hk[3 * C:4 * C] = 0
    rm[Q_LA] = 0
    hs[:] = 0


# -- lists -----------------------------------------------------------------------------
# hk[s] = the next newer slot (-1: s is the head), hk[C + s] = the next older (-1: tail),
# hk[2C + s] = the queue (Q_NONE, q, or q + Q_GONE once taken as a victim)

@tiny
def _push(rm, hk, q, s):
    C = rm[Q_C]
    h = rm[Q_HEAD + q]
    hk[s] = -1
    hk[C + s] = h
    if h >= 0:
        hk[h] = s
    else:
        rm[Q_TAIL + q] = s
    rm[Q_HEAD + q] = s
    hk[2 * C + s] = q
    rm[Q_SIZE + q] += 1


@tiny
def _unlink(rm, hk, s):
    """Take ``s`` off its list (it must be on one: qid in [0, Q_GONE))."""
    C = rm[Q_C]
    q = hk[2 * C + s]
    nw, old = hk[s], hk[C + s]
    if nw >= 0:
        hk[C + nw] = old
    else:
        rm[Q_HEAD + q] = old
    if old >= 0:
        hk[old] = nw
    else:
        rm[Q_TAIL + q] = nw
    if rm[Q_HAND] == s:
        rm[Q_HAND] = nw
    rm[Q_SIZE + q] -= 1
    hk[2 * C + s] = Q_NONE


@tiny
def _qid(rm, hk, s):
    return hk[2 * rm[Q_C] + s]


@tiny
def _take(rm, hk, s):
    """``s`` is a victim: off its list, marked taken."""
    q = hk[2 * rm[Q_C] + s]
    _unlink(rm, hk, s)
    hk[2 * rm[Q_C] + s] = q + Q_GONE


@helper
def _avail_from(rm, hk, s, keys_t, pins, mark):
    """The first slot from ``s`` toward newer rows that the search may take (unlinking
    nodes of emptied slots on the way), or -1."""
    while s >= 0:
        nw = hk[s]
        if keys_t[s] < 0:
            _unlink(rm, hk, s)
        elif pins[s] == 0 and mark[s] == 0 and (rm[Q_LA] == 0 or hk[3 * rm[Q_C] + s] == 0):
            return s  # (lookahead over this policy: rows the window uses are passed over)
        s = nw
    return -1


@tiny
def _tail(rm, hk, q, keys_t, pins, mark):
    return _avail_from(rm, hk, rm[Q_TAIL + q], keys_t, pins, mark)


# -- ghosts: rings of row hashes (0 = deleted) and a hash table hash -> ring position ----
# table keys at hs[T + i], values at hs[T + TH + i]: 2 * pos + list + 1 (0: empty,
# -1 with key 0: a tombstone)

@tiny
def _gring(rm, lst):
    return rm[G_RING] + lst * rm[G_RSZ]


@helper
def _gfind(rm, hs, h):
    """The table index holding ``h``, or -1."""
    T, TH = rm[G_TABLE], rm[G_TH]
    i = h & (TH - 1)
    while True:
        k = hs[T + i]
        if k == h:
            return i
        if k == 0 and hs[T + TH + i] == 0:
            return np.int64(-1)
        i = (i + 1) & (TH - 1)


@helper
def _gput(rm, hs, h, val):
    T, TH = rm[G_TABLE], rm[G_TH]
    i = h & (TH - 1)
    while hs[T + i] != 0:
        i = (i + 1) & (TH - 1)
    if hs[T + TH + i] == 0:
        rm[G_USED] += 1
    hs[T + i] = h
    hs[T + TH + i] = val


@helper
def _grebuild(rm, hs):
    """Empty the table and enter every live ring entry again (no tombstones left)."""
    T, TH, R = rm[G_TABLE], rm[G_TH], rm[G_RSZ]
    for i in range(2 * TH):
        hs[T + i] = 0
    rm[G_USED] = 0
    for lst in range(2):
        b = _gring(rm, lst)
        for p in range(rm[G_LO + lst], rm[G_HI + lst]):
            h = hs[b + p % R]
            if h != 0:
                _gput(rm, hs, h, 2 * p + lst + 1)


@helper
def ghost_of(rm, hs, h):
    """Which ghost holds row hash ``h`` (0 or 1), or -1."""
    if rm[G_TH] == 0 or (rm[G_LIVE] == 0 and rm[G_LIVE + 1] == 0):
        return np.int64(-1)
    i = _gfind(rm, hs, h)
    if i < 0:
        return np.int64(-1)
    return (hs[rm[G_TABLE] + rm[G_TH] + i] - 1) & 1


@helper
def ghost_del(rm, hs, h):
    i = _gfind(rm, hs, h)
    if i < 0:
        return
    T, TH, R = rm[G_TABLE], rm[G_TH], rm[G_RSZ]
    v = hs[T + TH + i] - 1
    lst, p = v & 1, v >> 1
    hs[_gring(rm, lst) + p % R] = 0
    rm[G_LIVE + lst] -= 1
    hs[T + i] = 0
    hs[T + TH + i] = -1  # a tombstone


@helper
def ghost_pop(rm, hs, lst):
    """Forget the oldest live entry of ghost ``lst``."""
    R = rm[G_RSZ]
    b = _gring(rm, lst)
    while rm[G_LO + lst] < rm[G_HI + lst]:
        h = hs[b + rm[G_LO + lst] % R]
        if h != 0:
            ghost_del(rm, hs, h)
            rm[G_LO + lst] += 1
            return
        rm[G_LO + lst] += 1


@helper
def ghost_add(rm, hs, h, lst):
    """Row hash ``h`` enters ghost ``lst`` (the newest; the oldest leaves when full);
    already in a ghost: nothing changes (a FIFO's hit)."""
    if rm[G_CAP + lst] <= 0 or _gfind(rm, hs, h) >= 0:
        return
    if rm[G_LIVE + lst] >= rm[G_CAP + lst]:
        ghost_pop(rm, hs, lst)
    R = rm[G_RSZ]
    b = _gring(rm, lst)
    if rm[G_HI + lst] - rm[G_LO + lst] >= R:  # the ring is full of deleted entries: compact
        w = rm[G_LO + lst]
        for p in range(rm[G_LO + lst], rm[G_HI + lst]):
            v = hs[b + p % R]
            if v != 0:
                hs[b + w % R] = v
                w += 1
        for p in range(w, rm[G_HI + lst]):
            hs[b + p % R] = 0
        rm[G_HI + lst] = w
        _grebuild(rm, hs)
    if 2 * (rm[G_USED] + 1) > rm[G_TH]:
        _grebuild(rm, hs)
    p = rm[G_HI + lst]
    hs[b + p % R] = h
    rm[G_HI + lst] = p + 1
    rm[G_LIVE + lst] += 1
    _gput(rm, hs, h, 2 * p + lst + 1)


# -- W-TinyLFU's sketch: 4 rows of K_W int64 counts at hs[K_OFF:] (hiermem.core.sketch) --

@helper
def sketch_est(rm, hs, h):
    return _sk.estimate(hs, rm[K_OFF], rm[K_W], h)


@helper
def sketch_add(rm, hs, h):
    """Minimal increment: only the counts at the row's minimum grow."""
    _sk.increment(hs, rm[K_OFF], rm[K_W], h)


@helper
def _sketch_main_hit(rm, hs, h):
    sketch_add(rm, hs, h)
    rm[K_ADDS] += 1
    if rm[K_ADDS] >= rm[K_SAMPLE]:
        rm[K_ADDS] = 0
        _sk.halve(hs, rm[K_OFF], rm[K_W])


# -- accesses ----------------------------------------------------------------------------

@helper
def _enter(params, code, score, uses, rm, hk, hs, s, fresh):
    """Row in slot ``s`` (not on a list) enters the tier's queues: ``fresh`` from disk or
    the initialiser (ghosts and sketch see it), else carried from another tier."""
    if code == SIEVE:
        if fresh:
            score[s] = 0.0
        _push(rm, hk, 0, s)
    elif code == S3FIFO:
        g = ghost_of(rm, hs, uses[s]) if fresh else np.int64(-1)
        if fresh:
            score[s] = 0.0
        if g >= 0:
            ghost_del(rm, hs, uses[s])
            _push(rm, hk, 1, s)
        elif rm[Q_EVICTED] == 0 and rm[Q_SIZE] >= rm[Q_SMALL]:
            _push(rm, hk, 1, s)
        else:
            _push(rm, hk, 0, s)
    elif code == ARC:
        g = ghost_of(rm, hs, uses[s]) if fresh else np.int64(-1)
        if g >= 0:
            if rm[Q_PRE] > 0:
                rm[Q_PRE] -= 1
            else:  # not seen before the victims were picked: adapt now
                _arc_adapt(params, rm, g)
            ghost_del(rm, hs, uses[s])
            _push(rm, hk, 1, s)
        else:
            _push(rm, hk, 0, s)
    else:  # WTINYLFU
        _push(rm, hk, 0, s)
        if fresh:
            sketch_add(rm, hs, uses[s])


@helper
def _hit(params, code, score, uses, rm, hk, hs, s, count):
    q = _qid(rm, hk, s)
    if code == SIEVE:
        score[s] = 1.0
    elif code == S3FIFO:
        score[s] += count
    elif code == ARC:
        _unlink(rm, hk, s)
        _push(rm, hk, 1, s)
    else:  # WTINYLFU: window LRU; probation -> protected; protected LRU
        _unlink(rm, hk, s)
        if q == 0:
            _push(rm, hk, 0, s)
        else:
            _sketch_main_hit(rm, hs, uses[s])
            _push(rm, hk, 2, s)
            while rm[Q_SIZE + 2] > rm[Q_PROT]:  # protected over its share: its LRU back to probation
                t = rm[Q_TAIL + 2]
                _unlink(rm, hk, t)
                _push(rm, hk, 1, t)


@helper
def access(params, code, key, score, uses, rm, hk, hs, s, clock, count, insert):
    """A row entered slot ``s`` (``insert``) or was used ``count`` times there."""
    key[s] = clock
    q = _qid(rm, hk, s)
    if insert:
        hk[3 * rm[Q_C] + s] = 0
        if q >= 0 and q < Q_GONE:  # the node of the slot's last row
            _unlink(rm, hk, s)
        hk[2 * rm[Q_C] + s] = Q_NONE
        _enter(params, code, score, uses, rm, hk, hs, s, True)
        return
    if q < 0 or q >= Q_GONE or q == Q_ADM:  # a victim whose eviction did not happen, a carried key,
        if q == Q_ADM:  # or a row the admission filter refused: used again, it enters the queues
            _unlink(rm, hk, s)
        hk[2 * rm[Q_C] + s] = Q_NONE
        _enter(params, code, score, uses, rm, hk, hs, s, False)
    _hit(params, code, score, uses, rm, hk, hs, s, count)


@helper
def carry(params, code, score, uses, rm, hk, hs, s):
    """A row moved into slot ``s`` from the other tier (its score and hash came along)."""
    hk[3 * rm[Q_C] + s] = 0
    q = _qid(rm, hk, s)
    if q >= 0 and q < Q_GONE:
        _unlink(rm, hk, s)
    hk[2 * rm[Q_C] + s] = Q_NONE
    _enter(params, code, score, uses, rm, hk, hs, s, False)


# -- victims -----------------------------------------------------------------------------

@helper
def _arc_adapt(params, rm, g):
    """ARC's target ``p`` (a float, as libCacheSim's; kept in ``params[1]``) after a hit in
    ghost ``g``."""
    b1, b2 = np.float64(rm[G_LIVE]), np.float64(rm[G_LIVE + 1])
    if g == 0:
        params[1] = min(params[1] + max(b2 / max(b1, 1.0), 1.0), np.float64(rm[Q_C]))
    else:
        params[1] = max(params[1] - max(b1 / max(b2, 1.0), 1.0), 0.0)


@helper
def premiss(params, rm, hs, rh, mi, n):
    """The batch's misses ``mi[:n]`` (those entering the tier) meet the ghosts before the
    victims are picked, in libCacheSim's order.  ARC: a miss a ghost holds adapts ``p``
    (the last one's ghost picks REPLACE's tie).  S3-FIFO: it leaves the ghost (so the
    victims' ghost entries cannot push it out) for the pending list, which its insert
    reads.  ``rh``: the batch rows' hashes."""
    code = np.int64(params[PARAM_CODE])
    rm[Q_FLAG] = rm[Q_PRE] = 0
    if (code != ARC and code != S3FIFO) or rm[G_LIVE] == 0:
        if code != ARC or rm[G_LIVE + 1] == 0:
            return
    for j in range(n):
        h = rh[mi[j]]
        g = ghost_of(rm, hs, h)
        if g < 0:
            continue
        if code == ARC:
            _arc_adapt(params, rm, g)
            rm[Q_PRE] += 1
            rm[Q_FLAG] = g + 1
        elif g == 0:
            ghost_del(rm, hs, h)
            ghost_add(rm, hs, h, 1)


@helper
def _arc_replace(params, uses, rm, hk, hs, keys_t, pins, mark, l2):
    t1 = np.float64(rm[Q_SIZE])
    if t1 > 0 and (t1 > params[1] or (t1 == params[1] and l2)):
        s = _tail(rm, hk, 0, keys_t, pins, mark)
        if s >= 0:
            _take(rm, hk, s)
            ghost_add(rm, hs, uses[s], 0)
            return s
    s = _tail(rm, hk, 1, keys_t, pins, mark)
    if s >= 0:
        _take(rm, hk, s)
        ghost_add(rm, hs, uses[s], 1)
        return s
    s = _tail(rm, hk, 0, keys_t, pins, mark)
    if s >= 0:
        _take(rm, hk, s)
        ghost_add(rm, hs, uses[s], 0)
    return s


@helper
def refuse(rm, hk, s):
    """The admission filter refused the row that entered slot ``s``: off its queue, onto
    ``Q_ADM``, whose oldest row is the next victim."""
    q = _qid(rm, hk, s)
    if q >= 0 and q < Q_GONE:
        _unlink(rm, hk, s)
    _push(rm, hk, Q_ADM, s)


@helper
def _one(params, code, score, uses, rm, hk, hs, keys_t, pins, mark):
    """One victim (taken off its list), or -1: the rows the admission filter refused
    first (no ghost remembers them), then the policy's own."""
    C = rm[Q_C]
    if rm[Q_SIZE + Q_ADM] > 0:
        s = _tail(rm, hk, Q_ADM, keys_t, pins, mark)
        if s >= 0:
            _take(rm, hk, s)
            return s
    if code == SIEVE:
        s = rm[Q_HAND]
        if s < 0 or _qid(rm, hk, s) != 0:
            s = rm[Q_TAIL]
        wrapped = 0
        while wrapped < 3:
            s = _avail_from(rm, hk, s, keys_t, pins, mark)
            if s < 0:
                wrapped += 1
                s = rm[Q_TAIL]
                continue
            if score[s] != 0.0:
                score[s] = 0.0
                s = hk[s]
                continue
            rm[Q_HAND] = hk[s]
            _take(rm, hk, s)
            return s
        return np.int64(-1)
    if code == S3FIFO:
        rm[Q_EVICTED] = 1
        for _round in range(2):
            if rm[Q_SIZE + 1] > rm[Q_MAIN] or rm[Q_SIZE] == 0 or _round == 1:
                while True:
                    s = _tail(rm, hk, 1, keys_t, pins, mark)
                    if s < 0:
                        break
                    f = score[s]
                    if f >= 1.0:
                        _unlink(rm, hk, s)
                        _push(rm, hk, 1, s)
                        score[s] = min(f, 3.0) - 1.0
                    else:
                        _take(rm, hk, s)
                        return s
                if _round == 1:
                    break
            while True:
                s = _tail(rm, hk, 0, keys_t, pins, mark)
                if s < 0:
                    break
                if score[s] >= 2.0:  # move-to-main threshold
                    _unlink(rm, hk, s)
                    _push(rm, hk, 1, s)
                    score[s] = 0.0
                else:
                    ghost_add(rm, hs, uses[s], 0)
                    _take(rm, hk, s)
                    return s
        return np.int64(-1)
    if code == ARC:
        if rm[Q_FLAG] != 0:
            l2 = rm[Q_FLAG] == 2
            rm[Q_FLAG] = 0
            return _arc_replace(params, uses, rm, hk, hs, keys_t, pins, mark, l2)
        t1, b1 = rm[Q_SIZE], rm[G_LIVE]
        if t1 + b1 + 1 > C:
            if t1 < C and b1 > 0:
                ghost_pop(rm, hs, 0)
                return _arc_replace(params, uses, rm, hk, hs, keys_t, pins, mark, False)
            s = _tail(rm, hk, 0, keys_t, pins, mark)
            if s >= 0:
                _take(rm, hk, s)
                return s
            return _arc_replace(params, uses, rm, hk, hs, keys_t, pins, mark, False)
        if t1 + b1 + rm[Q_SIZE + 1] + rm[G_LIVE + 1] >= 2 * C:
            ghost_pop(rm, hs, 1)
        return _arc_replace(params, uses, rm, hk, hs, keys_t, pins, mark, False)
    # WTINYLFU
    while True:
        w = _tail(rm, hk, 0, keys_t, pins, mark)
        if w < 0:
            break
        if rm[Q_SIZE + 1] + rm[Q_SIZE + 2] + 1 <= rm[Q_MAIN]:  # main has room: the window's LRU moves in
            _unlink(rm, hk, w)
            sketch_add(rm, hs, uses[w])
            _push(rm, hk, 1, w)  # into probation (Caffeine's rule; only hits promote to protected)
            continue
        m = _tail(rm, hk, 1, keys_t, pins, mark)
        if m < 0:
            m = _tail(rm, hk, 2, keys_t, pins, mark)
        sketch_ok = m >= 0 and sketch_est(rm, hs, uses[w]) > sketch_est(rm, hs, uses[m])
        if sketch_ok:
            _take(rm, hk, m)
            _unlink(rm, hk, w)
            _push(rm, hk, 1, w)
            sketch_add(rm, hs, uses[w])
            return m
        _take(rm, hk, w)
        sketch_add(rm, hs, uses[w])
        return w
    s = _tail(rm, hk, 1, keys_t, pins, mark)
    if s < 0:
        s = _tail(rm, hk, 2, keys_t, pins, mark)
    if s >= 0:
        _take(rm, hk, s)
    return s


@helper
def _relink(params, code, score, uses, rm, hk, hs, keys_t, mark):
    """Every occupied slot that no list holds (and the caller did not mark) enters its
    queues again (after a plan whose I/O failed left its victims taken)."""
    C = rm[Q_C]
    for s in range(min(C, keys_t.size)):
        q = hk[2 * C + s]
        if keys_t[s] >= 0 and mark[s] == 0 and (q < 0 or q >= Q_GONE):
            hk[2 * C + s] = Q_NONE
            _enter(params, code, score, uses, rm, hk, hs, s, False)


@helper
def _window_victims(rm, hk, keys_t, pins, mark, n, out, got):
    """Lookahead over a queue policy, when only rows the window uses are left: the one
    used furthest ahead first (ties: the lower slot), by a pass each."""
    C = rm[Q_C]
    while got < n:
        best = np.int64(-1)
        for s in range(min(C, keys_t.size)):
            q = hk[2 * C + s]
            nx = hk[3 * C + s]
            if nx > 0 and q >= 0 and q < Q_GONE and keys_t[s] >= 0 and pins[s] == 0 and mark[s] == 0:
                if best < 0 or nx > hk[3 * C + best]:
                    best = s
        if best < 0:
            break
        _take(rm, hk, best)
        out[got] = best
        got += 1
    return got


@kernel
def lookahead_marks(pol, slots, nxt):
    """Lookahead over a queue policy: the rows in ``slots`` are next used ``nxt`` batches
    ahead (this set replaces the last)."""
    rm, hk = pol[4], pol[7]
    C = rm[Q_C]
    for s in range(C):
        hk[3 * C + s] = 0
    for i in range(slots.size):
        hk[3 * C + slots[i]] = max(nxt[i], 1)


@helper
def victims(params, score, uses, rm, hk, hs, keys_t, pins, mark, n, out):
    """``out[:n]``: ``n`` victims in the order the policy evicts them; returns how many
    were found (fewer when fewer are evictable)."""
    code = np.int64(params[PARAM_CODE])
    got = np.int64(0)
    for attempt in range(2):
        while got < n:
            s = _one(params, code, score, uses, rm, hk, hs, keys_t, pins, mark)
            if s < 0:
                break
            out[got] = s
            got += 1
        if rm[Q_LA] != 0:  # every other row is gone: the window's, the furthest next use first
            got = _window_victims(rm, hk, keys_t, pins, mark, n, out, got)
        if got == n or attempt == 1:
            break
        for j in range(got):
            mark[out[j]] += 4
        _relink(params, code, score, uses, rm, hk, hs, keys_t, mark)
        for j in range(got):
            mark[out[j]] -= 4
    rm[Q_FLAG] = 0
    return got


@kernel
def check(rm, hk, keys_t):
    """Whether the lists are consistent (a debugging aid): every list's nodes link both
    ways, and its size counts them."""
    C = rm[Q_C]
    for q in range(NQ):
        n = np.int64(0)
        s = rm[Q_HEAD + q]
        prev = np.int64(-1)
        while s >= 0:
            if hk[2 * C + s] != q or hk[s] != prev:
                return False
            n += 1
            if n > C:
                return False
            prev = s
            s = hk[C + s]
        if prev != rm[Q_TAIL + q] or n != rm[Q_SIZE + q]:
            return False
    return True


__all__ = ["Q_RMSIZE", "access", "premiss", "carry", "check", "ghost_add", "ghost_del", "ghost_of", "init_state",
           "is_queue", "layout", "refuse", "rowhash", "sketch_add", "sketch_est", "victims"]


@kernel
def victims_of(pol, keys_t, pins, mark, n, out):
    """:func:`victims` over a policy state tuple (tools and tests)."""
    _, score, uses, params, rm, _, _, hk, hs, _, _ = pol
    return victims(params, score, uses, rm, hk, hs, keys_t, pins, mark, n, out)
