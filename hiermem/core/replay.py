"""A whole trace replayed through the control plane in one compiled loop.

The simulator's plain replay (no prefetch): for each batch, the same dedup the store
does (a stable sort: distinct rows in ``(table, id)`` order, counts, last positions),
then :func:`~hiermem.core.plan.decide_` and :func:`~hiermem.core.plan.commit_`, the
store's own placement (inlined), with "written to LMDB" a bit per row instead of I/O.
No Python runs per batch or per access (:func:`replay`), and the loop between two sorts
is compiled without reference counting (:func:`~hiermem.core.jit.leaf`), so a trace of
single-id batches replays at memory speed.  :func:`replay_pipelined` is the same work on
two threads for traces of large batches: each batch's dedup runs a batch ahead on a
worker (Python hands each large batch over: tens of microseconds against milliseconds).
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from .index import find1
from .jit import kernel, leaf, prefetch
from .victims import _sort_pairs
from .names import A_ON, BASE, CAP, CAPACITY, DIRECT, FIRST_QUEUE, IX_KIND, ONDEV, PARAM_CODE, RH, SLOT, STATUS
from .names import IO_UPDATED_ROWS as _UPDATED, IO_UPDATES as _UPDATES
from .plan import commit_, decide_, hit1
from .written import fetch_, moved_, write_back_

_STAGE = 8  # a per-access replay prefetches ids 32 on (table), 16 on (index entry), 8 on (record)
_AHEAD = 32  # ids ahead whose tag the dedup prefetches (19 -> 11 ns an id, 10M Zipf ids over 1M rows)


@leaf
def _run(ix, dev, dpol, host, hpol, rows, offsets, table_of_row, row_base, row_hash, written, updates, counters, io,
         row_bytes, ws, res, scratch, u0, i, c0):
    """Replay batch ``i`` (when it has more than one id, its ``u0`` distinct rows are in
    ``scratch[:4, :u0]``: tables, ids, last clocks, counts, from :func:`_dedup`), then the
    batches after it up to the next one of more than one id.  Returns the next batch and
    the clock, or ``(-1 - i, c0)`` when batch ``i`` does not fit the tiers.  A
    :func:`~hiermem.core.jit.leaf`: no reference counting in the per-access loop.
    ``row_hash``: each dense row's hash where a policy uses them (the store's,
    :func:`hiermem.core.sketch.rowhash` of its table and id), else unread."""
    meta, offsets_, slot_of, rev, tab = ix
    dkt, dkk, ddirty, dpins, dfree, dtm, dmark = dev
    dkey, dscore, duses, dparams, drm, drs, drk, dhk, dhs, dsk, dss = dpol
    hkt, hkk, hdirty, hpins, hfree, htm, hmark = host
    hkey, hscore, huses, hparams, hrm, hrs, hrk, hhk, hhs, hsk, hss = hpol
    bt, bk, clock, counts = scratch[0], scratch[1], scratch[2], scratch[3]
    D = dtm[CAP]
    account = True
    nb = offsets.size - 1
    start = i
    direct = meta[IX_KIND] == DIRECT  # a direct index: an id's entry is known without probing
    hashing = (np.int64(dparams[PARAM_CODE]) >= FIRST_QUEUE or np.int64(hparams[PARAM_CODE]) >= FIRST_QUEUE
               or drm[A_ON] != 0)
    rh = ws[RH]
    while i < nb:
        a, b = offsets[i], offsets[i + 1]
        n = b - a
        if n == 0:
            i += 1
            continue
        if n == 1:
            u = 1
            if direct and a + 4 * _STAGE < rows.size:  # later accesses' index entries and records
                prefetch(table_of_row, rows[a + 4 * _STAGE])
                r2 = rows[a + 2 * _STAGE]
                t2 = table_of_row[r2]
                prefetch(slot_of, offsets_[t2] + r2 - row_base[t2])
                r2 = rows[a + _STAGE]
                t2 = table_of_row[r2]
                s2 = find1(meta, offsets_, slot_of, tab, t2, r2 - row_base[t2])
                if s2 >= 0 and s2 < D:
                    prefetch(dkt, s2)
            r = rows[a]
            t = table_of_row[r]
            k = r - row_base[t]
            s = find1(meta, offsets_, slot_of, tab, t, k)
            if s >= 0 and s < D:  # a device hit: decide_ finds no miss, and commit_ does this
                hit1(counters, t, dkey, dscore, duses, dparams, drm, dhk, dhs, s, c0, 1)
                if updates:
                    ddirty[s] = True
                    io[_UPDATES] += 1
                    io[_UPDATED] += 1
                c0 += 1
                i += 1
                continue
            bt[0] = t
            bk[0] = k
            clock[0] = c0
            counts[0] = 1
            if hashing:
                rh[0] = row_hash[r]
        else:
            if i != start:  # a later batch of more than one id: deduplicated by the caller
                return i, c0
            u = u0
            if hashing:
                for j in range(u):
                    rh[j] = row_hash[row_base[bt[j]] + bk[j]]
        t_, k_, cl_, cn_ = bt[:u], bk[:u], clock[:u], counts[:u]
        decide_(ix, dev, dpol, host, hpol, t_, k_, ws, res)
        if res[STATUS] == CAPACITY:
            return -1 - i, c0
        fetch_(ws, res, t_, k_, row_base, written, io, row_bytes)  # the written-rows bitmap: LMDB
        write_back_(ws, res, dkt, dkk, hkt, hkk, D, htm[BASE], row_base, written, io, row_bytes)
        commit_(ix, dev, dpol, host, hpol, t_, k_, cl_, cn_, account, ws, res, counters)
        moved_(res, io, row_bytes)
        if updates:
            slot, ondev = ws[SLOT], ws[ONDEV]
            for j in range(u):
                if ondev[j]:
                    ddirty[slot[j]] = True
                else:
                    hdirty[slot[j]] = True
            io[_UPDATES] += 1
            io[_UPDATED] += u
        c0 += n
        i += 1
    return i, c0


@kernel
def _dedup(rows, a, b, table_of_row, row_base, tag, i, c0, scratch):
    """The distinct rows of batch ``i`` (``rows[a:b]``) in ascending dense row order, i.e.
    ``(table, id)`` order, as the store's stable sort gives them: ``scratch[0..3, :u]`` =
    table, id, clock of the last occurrence, count; returns ``u``.  ``tag`` (int64 per
    dense row): ``i << 32 | q`` once batch ``i`` saw the row, ``q`` its first-seen place.
    One pass over the ids (counts and last clocks by first-seen place: one array probed
    per id), then a radix sort of the distinct rows only (numba's ``np.sort`` of 22k rows
    took 1.2 ms, the radix sort 0.2; the dedup was half the batched replay's time).
    The tag of the id ``_AHEAD`` places on is prefetched."""
    bt, bk, clock, counts = scratch[0], scratch[1], scratch[2], scratch[3]
    rk, qq, cnt, last = scratch[4], scratch[5], scratch[6], scratch[7]
    u = np.int64(0)
    hi = np.int64(i) << 32
    for j in range(a, b):
        if j + _AHEAD < b:
            prefetch(tag, rows[j + _AHEAD])  # a Zipf batch's tail ids miss the cache
        r = rows[j]
        tg = tag[r]
        if tg >> 32 != i:
            tg = hi | u
            tag[r] = tg
            rk[u] = r
            qq[u] = u
            cnt[u] = 0
            u += 1
        q = tg & 0xFFFFFFFF
        cnt[q] += 1
        last[q] = c0 + (j - a)  # the last occurrence's
    _sort_pairs(rk, qq, u)  # distinct rows ascending, with their first-seen places
    for p in range(u):
        r = rk[p]
        q = qq[p]
        t = table_of_row[r]
        bt[p] = t
        bk[p] = r - row_base[t]
        counts[p] = cnt[q]
        clock[p] = last[q]
    return u


@kernel
def replay(ix, dev, dpol, host, hpol, rows, offsets, table_of_row, row_base, row_hash, written, updates, counters,
           io, row_bytes, ws, res, clock0):
    """Replay batches ``rows[offsets[i]:offsets[i + 1]]`` (dense row numbers, int64) in
    order.  ``table_of_row``/``row_base``: each dense row's table and the first dense
    row of each table (index keys are ``(table, row - row_base[table])``); ``row_hash``
    (int64 per dense row): the store's hash of each row, read where a policy uses them
    (queue policies, the admission filter; else one entry will do); ``written``
    (uint8 per row): has an LMDB copy.  Returns the clock after the last batch, or
    ``-1 - i`` when batch ``i`` does not fit the tiers (nothing of it applied).

    This kernel deduplicates each batch of more than one id (:func:`_dedup`, which
    allocates); :func:`_run`, compiled without reference counting, replays the batches
    between two of them."""
    nmax = np.int64(1)
    for i in range(offsets.size - 1):
        nmax = max(nmax, offsets[i + 1] - offsets[i])
    scratch = np.empty((8, nmax), dtype=np.int64)  # a batch's distinct rows: table, id, clock, count; + dedup's
    nr = table_of_row.size if nmax > 1 else 1
    tag = np.full(nr, -1, dtype=np.int64)
    i = np.int64(0)
    c0 = np.int64(clock0)
    nb = offsets.size - 1
    while i < nb:
        a, b = offsets[i], offsets[i + 1]
        u0 = np.int64(0)
        if b - a > 1:
            u0 = _dedup(rows, a, b, table_of_row, row_base, tag, i, c0, scratch)
        i, c0 = _run(ix, dev, dpol, host, hpol, rows, offsets, table_of_row, row_base, row_hash, written, updates,
                     counters, io, row_bytes, ws, res, scratch, u0, i, c0)
        if i < 0:
            return i
    return c0


@kernel
def dedup_batch(rows, offsets, table_of_row, row_base, tag, i, clock0, scratch):
    """:func:`_dedup` of batch ``i`` of a replay that started at clock ``clock0`` (batch
    ``i``'s first access has clock ``clock0 + offsets[i] - offsets[0]``); returns ``u``."""
    a, b = offsets[i], offsets[i + 1]
    return _dedup(rows, a, b, table_of_row, row_base, tag, i, clock0 + a - offsets[0], scratch)


PIPELINE_IDS = 4096  # mean ids of a multi-id batch from which replay_pipelined pays (2 handoffs a batch)


def replay_pipelined(ix, dev, dpol, host, hpol, rows, offsets, table_of_row, row_base, row_hash, written, updates,
                     counters, io, row_bytes, ws, res, clock0, depth: int = 2):
    """:func:`replay` on two threads: a worker deduplicates the batches of more than one
    id (:func:`dedup_batch`, which reads only the trace) up to ``depth`` batches ahead,
    while this thread places them (:func:`_run`, the same compiled placement).  Both
    kernels release the GIL.  Same arguments, result and state as :func:`replay`; the
    work is the same, so are the numbers.  Pays where batches are large (a handoff per
    batch of more than one id: ~tens of microseconds); ``replay`` otherwise."""
    lens = np.diff(offsets)
    multi = np.flatnonzero(lens > 1)
    nmax = max(1, int(lens.max())) if lens.size else 1
    bufs: queue.Queue = queue.Queue()
    for _ in range(depth + 1):
        bufs.put(np.empty((8, nmax), dtype=np.int64))
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()
    tag = np.full(table_of_row.size if multi.size else 1, -1, dtype=np.int64)

    def work() -> None:
        try:
            for j in multi:
                buf = bufs.get()
                if stop.is_set():
                    return
                ready.put((int(j), dedup_batch(rows, offsets, table_of_row, row_base, tag, j, clock0, buf), buf))
        except BaseException as e:  # re-raised by the placing thread
            ready.put(e)

    worker = threading.Thread(target=work, name="hiermem-replay-dedup", daemon=True)
    worker.start()
    single = np.empty((8, 1), dtype=np.int64)  # a run of single-id batches needs one column
    i, c0, k, nb = 0, int(clock0), 0, offsets.size - 1
    try:
        while i < nb:
            scratch, u0 = single, 0
            if k < multi.size and multi[k] == i:
                item = ready.get()
                if isinstance(item, BaseException):  # the worker failed
                    raise item
                j, u0, scratch = item
                assert j == i, (j, i)
                k += 1
            i, c0 = _run(ix, dev, dpol, host, hpol, rows, offsets, table_of_row, row_base, row_hash, written,
                         updates, counters, io, row_bytes, ws, res, scratch, u0, i, c0)
            if scratch is not single:
                bufs.put(scratch)
            if i < 0:
                return i
        return c0
    finally:
        stop.set()
        bufs.put(None)  # wakes a worker waiting for a buffer
        worker.join()


@kernel
def rank_dense(ids, hi, out, base):
    """``out[i] = base +`` the rank of ``ids[i]`` among the distinct ``ids`` (int64 in
    ``[0, hi]``, as ``np.unique``'s inverse); returns the number of distinct ids.  A
    presence table of ``hi + 1`` entries and two passes over the ids: the simulator's
    dense row numbering, which numpy did with three temporaries as large as the trace."""
    rank = np.zeros(hi + 1, dtype=np.int64)
    for i in range(ids.size):
        rank[ids[i]] = 1
    r = np.int64(0)
    for v in range(hi + 1):
        if rank[v]:
            rank[v] = r
            r += 1
    for i in range(ids.size):
        out[i] = base + rank[ids[i]]
    return r
