"""The placement of a batch: which rows move where, decided and committed by kernels.

``decide`` answers, for the distinct rows ``(t, k)`` of a batch, without changing any
state the store can observe: where each row is (device, host, or neither: LMDB or the
initialiser), which misses move up to the device (the first ``n_move`` in batch order,
as many as the device can hold beside its hits and pinned rows), which go to the host,
which device rows are evicted (to the host while it has room, the least valuable rest
straight to disk), which host rows are evicted to disk, which rows must be read from
disk and which dirty victims written down.  The caller then does the I/O that may fail
(LMDB read of the disk rows, write-back of the dirty victims), so an error leaves the
store as it was (:func:`abort` forgets the victim search's reservoir, whose entries the
victims left), and ``commit`` applies the plan to the index, the tiers' slot metadata,
the policies' keys (and the admission filter's verdict on the rows entering a full
device tier, :mod:`hiermem.core.admission`) and the counters, returning every row's slot and the copies the data
plane must make (host->device, device->host, disk->device, disk->host).

Arrays (all numpy, CPU): ``ix`` the index tuple (:mod:`hiermem.core.index`); a tier is
``(keys_t, keys_k, dirty, pins, free, tmeta, mark)`` with ``tmeta = [nfree, npinned,
capacity, base]``; a policy is the tuple of :mod:`hiermem.core.victims`.  ``ws`` (int64
``[NROWS, >= U]``) is the workspace and the plan (rows named below), ``res`` (int64
``[NRES]``) its counts.  Row data never enters here.  ``decide_``/``commit_`` are the
rule, once: inlined at numba's IR level (:func:`hiermem.core.jit.inline`) into the
``decide``/``commit`` kernels (the store's and the simulator's batch placement) and into
the compiled replay loop (:mod:`hiermem.core.replay`), so no call passes their ~45 arrays.
"""

from __future__ import annotations

import numpy as np

from .index import find, find1, insert1, remove1
from .names import (  # noqa: F401  (the workspace rows, res entries and tmeta fields: re-exported)
    BASE, CAP, CAPACITY, DEV_EV, DIRECT, DISK, DN_DST, DN_SRC, ENTRY, FOUND, G, HOST_EV, IX_KIND, LFU_DECAY, M, MI,
    MOVED, N_DISK, N_DN, N_MOVE, N_SKIP, N_UP, N_VD, N_VH, N_WB, NA, NB, NC, NE, NEW_DST, NFREE, NPINNED, NRES,
    NROWS, OK, ONDEV, PARAM_CODE, P_RM, RH, RM_TAU, RM_VALID, SLOT, STATUS, SV_DIRTY, SV_K, SV_KEY, SV_PINS,
    SV_SCORE, SV_T, SV_USES, UP_DST, UP_SRC, VD, VH, WB)
from .names import C_DEVICE as _DEV, C_DISK as _DISK, C_HOST as _HOST  # counters [table, tier, stat]
from .names import EVICTIONS as _EVICTIONS, HITS as _HITS, LOOKUPS as _LOOKUPS, MISSES as _MISSES
from .names import WRITEBACKS as _WRITEBACKS
from .jit import inline, kernel, leaf, prefetch, tiny
from .names import A_ON, ARC, FIRST_QUEUE, LOOKAHEAD, PARAM_BASE, S3FIFO
from .admission import estimate as adm_estimate, record as adm_record, record_batch as adm_record_batch
from .admission import set_slot_hash, slot_hash, victims_max
from .policy import SOON, outside_key, probation, touch
from .queues import carry as qcarry, premiss
from .victims import drop, set_key, victims_

AHEAD = 8  # rows ahead whose slot state the swap loops prefetch


def workspace(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A plan's arrays for batches of up to ``n`` distinct rows (rows that change tier
    are saved in it: up to two per distinct row)."""
    return np.empty((NROWS, 2 * max(1, n)), dtype=np.int64), np.zeros(NRES, dtype=np.int64)


@tiny
def _mark_held(pins, mark, slots, base, n, flag):
    """Mark (flag 1) or clear (flag 0) tier slots ``slots[:n] - base``; returns how many
    of them are unpinned (the evictable ones the batch holds)."""
    held = np.int64(0)
    for j in range(n):
        if j + AHEAD < n:  # the misses' host records are cold
            prefetch(pins, slots[j + AHEAD] - base)
        s = slots[j] - base
        mark[s] = flag
        if pins[s] == 0:
            held += 1
    return held


@inline
def decide_(ix, dev, dpol, host, hpol, bt, bk, ws, res):
    """:func:`decide`, inlined into its callers (the kernel and the compiled replay)."""
    meta, offsets, slot_of, rev, tab = ix
    dkt, dkk, ddirty, dpins, dfree, dtm, dmark = dev
    dkey, dscore, duses, dparams, drm, drs, drk, dhk, dhs, dsk, dss = dpol
    hkt, hkk, hdirty, hpins, hfree, htm, hmark = host
    hkey, hscore, huses, hparams, hrm, hrs, hrk, hhk, hhs, hsk, hss = hpol
    U = bk.size
    D = dtm[CAP]
    Hb = htm[BASE]
    g, mi = ws[G], ws[MI]
    if U == 1:  # a per-access trace's miss: no call
        g[0] = find1(meta, offsets, slot_of, tab, bt[0], bk[0])
    else:
        find(meta, offsets, slot_of, tab, bt, bk, g)
    m = np.int64(0)
    for i in range(U):
        if g[i] < 0 or g[i] >= D:
            mi[m] = i
            m += 1
    for j in range(NRES):
        res[j] = 0
    res[M] = m
    if m == 0:
        return
    dnfree = dtm[NFREE]
    dev_ev = np.int64(0)
    hits = ws[MOVED]  # scratch: the device hits' slots
    nh = np.int64(0)
    n_move = m
    if m > dnfree:
        for i in range(U):
            if g[i] >= 0 and g[i] < D:
                hits[nh] = g[i]
                nh += 1
        held = _mark_held(dpins, dmark, hits, 0, nh, 1)
        dev_ev = (D - dnfree) - dtm[NPINNED] - held
        n_move = min(m, dnfree + dev_ev)
    na = nb = nc = ne = np.int64(0)
    for j in range(m):
        on_host = g[mi[j]] >= D
        if j < n_move:
            if on_host:
                na += 1
            else:
                nb += 1
        elif on_host:
            nc += 1
        else:
            ne += 1
    n_vd = max(0, n_move - dnfree)
    hnfree = htm[NFREE]
    host_ev = np.int64(0)
    hheld = ws[ENTRY]  # scratch: the misses' host slots
    nhh = np.int64(0)
    if n_vd + ne <= hnfree + na:
        room_h = hnfree + na - ne
    else:
        for j in range(m):
            if g[mi[j]] >= D:
                hheld[nhh] = g[mi[j]]
                nhh += 1
        held = _mark_held(hpins, hmark, hheld, Hb, nhh, 1)
        host_ev = (htm[CAP] - hnfree) - htm[NPINNED] - held
        room_h = hnfree + na + host_ev - ne
    if room_h < 0:
        _mark_held(dpins, dmark, hits, 0, nh, 0)
        _mark_held(hpins, hmark, hheld, Hb, nhh, 0)
        res[STATUS] = CAPACITY
        return
    vd, vh = ws[VD], ws[VH]
    if n_vd:
        if np.int64(dparams[PARAM_CODE]) == ARC or np.int64(dparams[PARAM_CODE]) == S3FIFO:
            premiss(dparams, drm, dhs, ws[RH], mi, n_move)  # the misses meet the ghosts first
        got = victims_(dkey, dscore, duses, dparams, drm, drs, drk, dhk, dhs, dsk, dss, dkt, dpins, dmark, n_vd, dev_ev,
                       D - dnfree, vd)
        assert got == n_vd
    n_skip = max(0, n_vd - room_h)
    n_vh = max(0, (n_vd - n_skip) + ne - hnfree - na)
    if n_vh:
        got = victims_(hkey, hscore, huses, hparams, hrm, hrs, hrk, hhk, hhs, hsk, hss, hkt, hpins, hmark, n_vh,
                       host_ev, htm[CAP] - hnfree, vh)
        assert got == n_vh
    if nh:
        _mark_held(dpins, dmark, hits, 0, nh, 0)
    if nhh:
        _mark_held(hpins, hmark, hheld, Hb, nhh, 0)
    disk = ws[DISK]
    nd = np.int64(0)
    for j in range(m):
        if g[mi[j]] < 0:
            disk[nd] = mi[j]
            nd += 1
    wb = ws[WB]
    nw = np.int64(0)
    for j in range(n_vh):
        if hdirty[vh[j]]:
            wb[nw] = Hb + vh[j]
            nw += 1
    for j in range(n_skip):
        if ddirty[vd[j]]:
            wb[nw] = vd[j]
            nw += 1
    res[N_MOVE], res[NA], res[NB], res[NC], res[NE] = n_move, na, nb, nc, ne
    res[N_VD], res[N_SKIP], res[N_VH], res[N_DISK], res[N_WB] = n_vd, n_skip, n_vh, nd, nw
    res[DEV_EV], res[HOST_EV] = dev_ev, host_ev


@kernel
def decide(ix, dev, dpol, host, hpol, bt, bk, ws, res):
    """Decide the placement of distinct rows ``(bt[i], bk[i])`` (int64 ``[U]``), whose
    hashes the caller has set in ``ws[RH]`` where a policy uses them (queue policies, the
    admission filter: :func:`hiermem.store.placing.place` has its backing set them).

    Fills ``ws[G]`` (each row's global slot or -1), ``ws[MI]`` (positions of device
    misses), ``ws[VD]``/``ws[VH]`` (victims, smallest key first), ``ws[DISK]`` (positions
    of the rows to read from disk), ``ws[WB]`` (dirty victims to write down: device slot
    ``s`` as ``s``, host slot ``s`` as ``base + s``) and the counts in ``res``;
    ``res[STATUS]`` is ``CAPACITY`` when the tiers cannot hold the batch beside their
    pinned rows (nothing decided).  Changes no index, tier or key.
    """
    decide_(ix, dev, dpol, host, hpol, bt, bk, ws, res)


@tiny
def _free(kt, dirty, pins, free, tm, s):
    """Empty slot ``s`` (pushed on the free stack)."""
    if pins[s] > 0:
        tm[NPINNED] -= 1
    kt[s] = -1
    dirty[s] = False
    pins[s] = 0
    free[tm[NFREE]] = s
    tm[NFREE] += 1


# The helpers below work on a whole list of slots per call: a call passes each array
# separately (tens of ns apiece), so per-row calls would cost more than the rows' work.

@leaf
def _touch_many(key, score, uses, params, rm, hk, hs, slots, pos, n, clock, counts, insert):
    """:func:`touch` slots ``slots[j]`` with the clock and count of batch row ``pos[j]``."""
    for j in range(n):
        i = pos[j]
        touch(key, score, uses, params, rm, hk, hs, slots[j], clock[i], counts[i], insert)


@tiny
def _evict1(meta, slot_of, rev, tab, kt, dirty, pins, free, tm, s, counters, tcode):
    """Drop the row in slot ``s`` (to disk) from the tier and the index."""
    t = kt[s]
    counters[t, tcode, _EVICTIONS] += 1
    if dirty[s]:
        counters[t, tcode, _WRITEBACKS] += 1
    remove1(meta, slot_of, rev, tab, tm[BASE] + s)
    _free(kt, dirty, pins, free, tm, s)


@leaf
def _admit_many(key, score, uses, params, rm, hk, hs, mi, n, slot, rh, full, vmax):
    """The admission filter (:mod:`hiermem.core.admission`) over the misses ``mi[:n]``
    that entered the device tier (now in ``slot[mi[j]]``, hashes ``rh``): each slot
    learns its row's hash; when the tier was ``full``, a row whose estimate does not beat
    ``vmax`` (its victims' largest) is put on probation."""
    for j in range(n):
        i = mi[j]
        s = slot[i]
        set_slot_hash(rm, hs, s, rh[i])
        if full and adm_estimate(rm, hs, rh[i]) <= vmax:
            probation(params, key, score, uses, rm, hk, hs, s)


@leaf
def _evict_many(meta, slot_of, rev, tab, kt, dirty, pins, free, tm, slots, n, counters, tcode):
    """:func:`_evict1` the rows in ``slots[:n]``.  Victims are the rows used longest ago
    (LRU) or least: their slot records and index entries are cold, so each is prefetched,
    the record ``2 * AHEAD`` rows on, the index entry (named by the record's ``rev``)
    ``AHEAD`` on."""
    base = tm[BASE]
    direct = meta[IX_KIND] == DIRECT
    for j in range(n):
        if j + 2 * AHEAD < n:
            s2 = slots[j + 2 * AHEAD]
            prefetch(kt, s2)
            prefetch(rev, base + s2)
        if direct and j + AHEAD < n:
            prefetch(slot_of, rev[base + slots[j + AHEAD]])
        _evict1(meta, slot_of, rev, tab, kt, dirty, pins, free, tm, slots[j], counters, tcode)


@leaf
def _save_many(rev, kt, kk, dirty, pins, free, tm, key, score, uses, extra, slots, n, ws, wsf, j0):
    """Save the rows of ``slots[:n]`` (keys, dirty bit, pins, policy state, index entry) in
    workspace columns ``j0..``, and empty their slots (:func:`_free`, written out: this
    loop is the hot path of a swap)."""
    base = tm[BASE]
    nfree = tm[NFREE]
    unpinned = np.int64(0)
    for j in range(n):
        if j + AHEAD < n:
            s2 = slots[j + AHEAD]
            prefetch(kt, s2)  # the slot's whole record (hiermem.core.layout)
            prefetch(rev, base + s2)
        s = slots[j]
        c = j0 + j
        ws[SV_T, c] = kt[s]
        ws[SV_K, c] = kk[s]
        ws[SV_DIRTY, c] = 1 if dirty[s] else 0
        p = pins[s]
        ws[SV_PINS, c] = p
        if p > 0:
            unpinned += 1
        ws[SV_KEY, c] = key[s]
        if extra:  # lfu_decay's score and uses, a queue policy's count and row hash
            wsf[c] = score[s]
            ws[SV_USES, c] = uses[s]
        g = base + s
        ws[ENTRY, c] = rev[g]
        rev[g] = -1
        kt[s] = -1
        dirty[s] = False
        pins[s] = 0
        free[nfree] = s
        nfree += 1
    tm[NFREE] = nfree
    tm[NPINNED] -= unpinned


@leaf
def _restore_many(meta, slot_of, rev, tab, kt, kk, dirty, pins, free, tm, key, score, uses, params, extra, rm, hk,
                  hs, n, dst, ws, wsf, j0, use, pos, clock, counts):
    """Put the rows saved in columns ``j0..j0+n`` into the next ``n`` free slots (written to
    ``dst``), re-pointing their index entries (:func:`set_key` and :func:`repoint1`
    written out: the hot path of a swap).  ``use``: row ``j`` is then used by batch row
    ``pos[j]`` (:func:`touch`, fused: its carried key is never entered in the victim
    search, where it would only lie stale until a later search pops it)."""
    tm[NFREE] -= n  # the last n pushed, in push order
    fb = tm[NFREE]
    base = tm[BASE]
    direct = meta[IX_KIND] == DIRECT
    valid, tau = rm[RM_VALID] != 0, rm[RM_TAU]
    code = np.int64(params[PARAM_CODE])
    queue = code >= FIRST_QUEUE
    pinned = np.int64(0)
    for j in range(n):
        if j + AHEAD < n:
            e2 = ws[ENTRY, j0 + j + AHEAD]
            if direct:
                prefetch(slot_of, e2)
            else:
                prefetch(tab, 3 * e2 + 2)
            d2 = free[fb + j + AHEAD]
            prefetch(kt, d2)  # the slot's whole record
            prefetch(rev, base + d2)
        d = free[fb + j]
        dst[j] = d
        c = j0 + j
        kt[d] = ws[SV_T, c]
        kk[d] = ws[SV_K, c]
        dirty[d] = ws[SV_DIRTY, c] != 0
        p = ws[SV_PINS, c]
        pins[d] = p
        if p > 0:
            pinned += 1
        if extra:
            score[d] = wsf[c]
            uses[d] = ws[SV_USES, c]
        k = ws[SV_KEY, c]
        if queue:
            key[d] = k
            qcarry(params, code, score, uses, rm, hk, hs, d)
        elif code == LOOKAHEAD:  # its base key (a window key's base is not kept: the oldest)
            b = np.int64(0) if k >= SOON else (k << 2 if np.int64(params[PARAM_BASE]) == LFU_DECAY else k)
            hk[d] = b
            hs[d] = -1
            k = outside_key(np.int64(params[PARAM_BASE]), b)
        if use:
            key[d] = k
            i = pos[j]
            touch(key, score, uses, params, rm, hk, hs, d, clock[i], counts[i], False)
        elif queue or code == LOOKAHEAD:  # (lookahead's victims come from a pass: no reservoir)
            key[d] = k
        elif valid and k <= tau:
            set_key(key, rm, hk, hs, d, k)
            valid = rm[RM_VALID] != 0
        else:
            key[d] = k
        e = ws[ENTRY, c]
        if direct:
            slot_of[e] = base + d
        else:
            tab[3 * e + 2] = base + d
        rev[base + d] = e
    tm[NPINNED] += pinned


@tiny
def _new1(meta, offsets, slot_of, rev, tab, kt, kk, dirty, pins, key, score, uses, params, rm, hk, hs, d, t, k, c,
          cnt, g, h):
    """Row ``(t, k)`` (hash ``h``), used ``cnt`` times, the last at ``c``, enters free
    slot ``d`` (global slot ``g``)."""
    kt[d] = t
    kk[d] = k
    dirty[d] = False
    pins[d] = 0
    if np.int64(params[PARAM_CODE]) >= FIRST_QUEUE:  # ghosts and sketches know rows by their hash
        uses[d] = h
    insert1(meta, offsets, slot_of, rev, tab, t, k, g)
    touch(key, score, uses, params, rm, hk, hs, d, c, cnt, True)


@leaf
def _new_many(meta, offsets, slot_of, rev, tab, kt, kk, dirty, pins, free, tm, key, score, uses, params, rm, hk, hs,
              pos, n, bt, bk, rh, clock, counts, slot, new_dst, jd):
    """Rows ``pos[:n]`` of the batch enter the tier (from disk or the initialiser) in the
    next ``n`` free slots: ``slot[pos[j]]`` and ``new_dst[jd + j]`` (global) get them."""
    tm[NFREE] -= n
    base = tm[NFREE]
    gb = tm[BASE]
    direct = meta[IX_KIND] == DIRECT
    for j in range(n):
        if j + AHEAD < n:  # the row's index entry and its new slot's record and reverse entry
            i2 = pos[j + AHEAD]
            d2 = free[base + j + AHEAD]
            if direct:
                prefetch(slot_of, offsets[bt[i2]] + bk[i2])
            prefetch(kt, d2)
            prefetch(rev, gb + d2)
        d = free[base + j]
        i = pos[j]
        _new1(meta, offsets, slot_of, rev, tab, kt, kk, dirty, pins, key, score, uses, params, rm, hk, hs, d, bt[i],
              bk[i], clock[i], counts[i], tm[BASE] + d, rh[i])
        slot[i] = d
        new_dst[jd + j] = tm[BASE] + d


@inline
def _account(bt, counts, g, mi, m, D, ws, res, counters):
    """Lookups, hits and misses per table and tier of an accounted placement.  Summed in
    registers over each run of one table's rows (a batch's rows come in table order) and
    added to ``counters`` once a run, not incremented per row through memory (rdtsc, a
    21.6k-row batch with its hits' key updates: 0.43 -> 0.36 Mcycles)."""
    U = bt.size
    i = j = np.int64(0)
    while i < U:
        t = bt[i]
        looked = hits = missed = host_hits = np.int64(0)
        while i < U and bt[i] == t:
            c = counts[i]
            looked += c
            if j < m and mi[j] == i:
                hits += c - 1
                missed += 1
                if g[i] >= D:
                    host_hits += 1
                j += 1
            else:
                hits += c
            i += 1
        counters[t, _DEV, _LOOKUPS] += looked
        counters[t, _DEV, _HITS] += hits
        counters[t, _DEV, _MISSES] += missed
        counters[t, _HOST, _LOOKUPS] += missed
        counters[t, _HOST, _HITS] += host_hits
    disk, found = ws[DISK], ws[FOUND]
    nd = res[N_DISK]
    j = np.int64(0)
    while j < nd:
        t = bt[disk[j]]
        reads = hits = np.int64(0)
        while j < nd and bt[disk[j]] == t:
            reads += 1
            if found[j]:
                hits += 1
            j += 1
        counters[t, _HOST, _MISSES] += reads
        counters[t, _DISK, _LOOKUPS] += reads
        counters[t, _DISK, _HITS] += hits
        counters[t, _DISK, _MISSES] += reads - hits


@tiny
def hit1(counters, t, key, score, uses, params, rm, hk, hs, s, clock, count):
    """An accounted batch of one row of table ``t``, used ``count`` times (the last at
    ``clock``), found in device slot ``s``: what :func:`commit_` does for it (the compiled
    replay's device hit, which skips :func:`decide_` too)."""
    counters[t, _DEV, _LOOKUPS] += count
    counters[t, _DEV, _HITS] += count
    if rm[A_ON] != 0:  # the admission filter counts the access
        adm_record(rm, hs, slot_hash(rm, hs, s))
    touch(key, score, uses, params, rm, hk, hs, s, clock, count, False)


@inline
def commit_(ix, dev, dpol, host, hpol, bt, bk, clock, counts, account, ws, res, counters):
    """:func:`commit`, inlined into its callers (the kernel and the compiled replay)."""
    meta, offsets, slot_of, rev, tab = ix
    dkt, dkk, ddirty, dpins, dfree, dtm, dmark = dev
    dkey, dscore, duses, dparams, drm, drs, drk, dhk, dhs, dsk, dss = dpol
    hkt, hkk, hdirty, hpins, hfree, htm, hmark = host
    hkey, hscore, huses, hparams, hrm, hrs, hrk, hhk, hhs, hsk, hss = hpol
    U = bk.size
    D = dtm[CAP]
    Hb = htm[BASE]
    g, mi, slot, ondev, moved = ws[G], ws[MI], ws[SLOT], ws[ONDEV], ws[MOVED]
    if U == 1 and res[M] == 0:  # a per-access trace's device hit: no call
        slot[0] = g[0]
        ondev[0] = 1
        moved[0] = 0
        if account:
            hit1(counters, bt[0], dkey, dscore, duses, dparams, drm, dhk, dhs, g[0], clock[0], counts[0])
        return
    wsf = ws[SV_SCORE].view(np.float64)  # saved scores (float64 bits)
    pos, sl = ws[SV_T], ws[SV_K]  # scratch until rows are saved: positions, slots
    m = res[M]
    nh = np.int64(0)
    for i in range(U):
        gi = g[i]
        moved[i] = 0
        if gi >= 0 and gi < D:
            slot[i] = gi
            ondev[i] = 1
            pos[nh] = i
            sl[nh] = gi
            nh += 1
    admission = drm[A_ON] != 0
    rh = ws[RH]
    if account:
        if admission:  # the filter counts the batch's accesses (each distinct row once)
            adm_record_batch(drm, dhs, rh, U)
        if nh:
            _touch_many(dkey, dscore, duses, dparams, drm, dhk, dhs, sl, pos, nh, clock, counts, False)
        _account(bt, counts, g, mi, m, D, ws, res, counters)
    if m == 0:
        return
    n_move, n_skip, n_vd = res[N_MOVE], res[N_SKIP], res[N_VD]
    vd = ws[VD]
    vmax = np.int64(-1)
    if admission and n_vd:  # the device is full: rows entering must beat its victims (before their slots go)
        vmax = victims_max(drm, dhs, vd, n_vd)
    # (each helper call passes every array once, about a microsecond: skipped when idle)
    if res[N_VH]:
        _evict_many(meta, slot_of, rev, tab, hkt, hdirty, hpins, hfree, htm, ws[VH], res[N_VH], counters, np.int64(_HOST))
    if n_skip == 1:  # a per-access trace's eviction: no call
        _evict1(meta, slot_of, rev, tab, dkt, ddirty, dpins, dfree, dtm, vd[0], counters, np.int64(_DEV))
    elif n_skip:
        _evict_many(meta, slot_of, rev, tab, dkt, ddirty, dpins, dfree, dtm, vd, n_skip, counters, np.int64(_DEV))
    # rows changing tier keep their index entries; saved before any slot is reused
    up_src, up_dst, dn_src, dn_dst = ws[UP_SRC], ws[UP_DST], ws[DN_SRC], ws[DN_DST]
    pa = ws[WB]  # scratch (the write-back is done): the batch positions of the rows coming up
    na = np.int64(0)
    for j in range(n_move):
        i = mi[j]
        gi = g[i]
        if gi >= D:
            up_src[na] = gi - Hb
            pa[na] = i
            na += 1
    nd = n_vd - n_skip
    for j in range(nd):
        if j + AHEAD < nd:
            prefetch(dkt, vd[n_skip + j + AHEAD])  # a victim's record is cold (used longest ago or least)
        s = vd[n_skip + j]
        dn_src[j] = s
        t = dkt[s]
        counters[t, _DEV, _EVICTIONS] += 1
        if ddirty[s]:
            counters[t, _DEV, _WRITEBACKS] += 1
    dcode = np.int64(dparams[PARAM_CODE])
    extra = dcode == LFU_DECAY or dcode == LOOKAHEAD or dcode >= FIRST_QUEUE
    if na:
        _save_many(rev, hkt, hkk, hdirty, hpins, hfree, htm, hkey, hscore, huses, extra, up_src, na, ws, wsf, np.int64(0))
    if nd:
        _save_many(rev, dkt, dkk, ddirty, dpins, dfree, dtm, dkey, dscore, duses, extra, dn_src, nd, ws, wsf, na)
    if na:
        _restore_many(meta, slot_of, rev, tab, dkt, dkk, ddirty, dpins, dfree, dtm, dkey, dscore, duses, dparams, extra,
                      drm, dhk, dhs, na, up_dst, ws, wsf, np.int64(0), account, pa, clock, counts)
    if nd:
        _restore_many(meta, slot_of, rev, tab, hkt, hkk, hdirty, hpins, hfree, htm, hkey, hscore, huses, hparams, extra,
                      hrm, hhk, hhs, nd, dn_dst, ws, wsf, na, False, pa, clock, counts)
    res[N_UP], res[N_DN] = na, nd
    # where each miss lands; rows from disk in disk order (device ones first)
    pb, pc, pe = ws[SV_T], ws[SV_K], ws[SV_DIRTY]  # scratch (saved rows are placed)
    sl = ws[SV_PINS]
    ja = jb = jc = je = np.int64(0)
    for j in range(m):
        i = mi[j]
        if j < n_move:
            moved[i] = 1
            ondev[i] = 1
            if g[i] >= D:
                slot[i] = up_dst[ja]
                ja += 1
            else:
                pb[jb] = i
                jb += 1
        else:
            ondev[i] = 0
            if g[i] >= D:
                slot[i] = g[i] - Hb
                pc[jc] = i
                sl[jc] = g[i] - Hb
                jc += 1
            else:
                pe[je] = i
                je += 1
    new_dst = ws[NEW_DST]
    if jb == 1:  # a per-access trace's miss: no call
        i = pb[0]
        dtm[NFREE] -= 1
        d = dfree[dtm[NFREE]]
        _new1(meta, offsets, slot_of, rev, tab, dkt, dkk, ddirty, dpins, dkey, dscore, duses, dparams, drm, dhk, dhs,
              d, bt[i], bk[i], clock[i], counts[i], dtm[BASE] + d, rh[i])
        slot[i] = d
        new_dst[0] = dtm[BASE] + d
    elif jb:
        _new_many(meta, offsets, slot_of, rev, tab, dkt, dkk, ddirty, dpins, dfree, dtm, dkey, dscore, duses, dparams,
                  drm, dhk, dhs, pb, jb, bt, bk, rh, clock, counts, slot, new_dst, np.int64(0))
    if account and jc:
        _touch_many(hkey, hscore, huses, hparams, hrm, hhk, hhs, sl, pc, jc, clock, counts, False)
    if je:
        _new_many(meta, offsets, slot_of, rev, tab, hkt, hkk, hdirty, hpins, hfree, htm, hkey, hscore, huses, hparams,
                  hrm, hhk, hhs, pe, je, bt, bk, rh, clock, counts, slot, new_dst, jb)
    if admission:
        _admit_many(dkey, dscore, duses, dparams, drm, dhk, dhs, mi, n_move, slot, rh, n_vd > 0, vmax)


@leaf
def commit(ix, dev, dpol, host, hpol, bt, bk, clock, counts, account, ws, res, counters):
    """Apply a plan from :func:`decide` (after its I/O: ``ws[FOUND][j]`` tells whether
    disk row ``j`` was read from LMDB).  Fills ``ws[SLOT]`` / ``ws[ONDEV]`` (each row's
    tier slot, and 1 on the device), ``ws[MOVED]`` (1 where a row came up to the
    device), and the copies for the data plane: ``ws[UP_SRC] -> ws[UP_DST]`` (host ->
    device, ``res[N_UP]`` rows), ``ws[DN_SRC] -> ws[DN_DST]`` (device -> host,
    ``res[N_DN]``), and disk row ``j`` into global slot ``ws[NEW_DST][j]``.
    ``account``: count lookups and use the rows (an unaccounted placement moves rows but
    never uses them).  ``clock, counts``: int64 ``[U]``; ``counters``: int64
    ``[tables, 3, 5]``.
    """
    commit_(ix, dev, dpol, host, hpol, bt, bk, clock, counts, account, ws, res, counters)


@kernel
def abort(dpol, hpol):
    """A plan was decided but its I/O failed: forget the reservoirs (victims left them)."""
    drop(dpol[P_RM])
    drop(hpol[P_RM])
