"""Write combining: eviction write-backs held in memory and committed to LMDB together.

An LMDB write transaction costs about as much as writing a few hundred rows before it
writes any (``scripts/bench_io.py --step-rows``: 6.3 us a row in commits of 100 rows,
2.9 in commits of 1,600, 1.8 in commits of 6,400 on the project's 2-core machine), and
every commit also rewrites the store's metadata.  A store whose steps evict a few
hundred dirty rows each (the Criteo-shaped workload of ``scripts/bench_train.py``: ~110)
spent more on commits than on rows.  :class:`WriteCombiner` keeps those rows, newest
record per row, until ``limit`` records are held; then they are committed in one
transaction (with the metadata once), or earlier with the next :meth:`DiskTier.write`
(a flush, a checkpoint, ``close``), in the same transaction as its rows.

The combined rows are part of the disk tier: reads of the disk tier (the store's misses,
``where``, ``count``) see them, newer than LMDB's copy.  What a crash may lose is what a
write-back not yet committed may lose with ``write_behind``: a row then holds its
flushed value or a value written down by a later commit, as the durability promise
allows (docs/reliability.md).

Rows are kept sorted by ``(table, id)`` (two int64 arrays) with the position of each
row's newest record in an append-only record buffer; a write-back is merged into them by
a compiled merge (O(rows held + rows added)), and a read looks rows up by binary search.
"""

from __future__ import annotations

import numpy as np

from ..core.jit import kernel


@kernel
def merge_runs(at, ak, ap, bt, bk, bp):
    """Merge two runs of rows, each sorted by ``(table, id)`` with no row twice: ``a``
    (``at, ak, ap``: int64 ``[n]``) and ``b`` (int64 ``[m]``); a row in both keeps ``b``'s
    ``p``.  Returns ``(t, k, p)``, int64 ``[<= n + m]``, sorted, each row once."""
    n, m = at.size, bt.size
    ot = np.empty(n + m, np.int64)
    ok = np.empty(n + m, np.int64)
    op = np.empty(n + m, np.int64)
    i = j = o = 0
    while i < n and j < m:
        if at[i] < bt[j] or (at[i] == bt[j] and ak[i] < bk[j]):
            ot[o], ok[o], op[o] = at[i], ak[i], ap[i]
            i += 1
        else:
            if at[i] == bt[j] and ak[i] == bk[j]:
                i += 1  # the same row: b's record is the newer
            ot[o], ok[o], op[o] = bt[j], bk[j], bp[j]
            j += 1
        o += 1
    while i < n:
        ot[o], ok[o], op[o] = at[i], ak[i], ap[i]
        i += 1
        o += 1
    while j < m:
        ot[o], ok[o], op[o] = bt[j], bk[j], bp[j]
        j += 1
        o += 1
    return ot[:o], ok[:o], op[:o]


@kernel
def fill_held(st, sk, sp, rec, table, qk, width, found, out):
    """For each id of ``qk`` (int64, any order) of table ``table`` held among the rows
    ``(st, sk)`` sorted by ``(table, id)``: ``found`` set and ``out`` its newest record
    (``rec[sp[row], :width]``), by binary search, in place."""
    n = st.size
    for q in range(qk.size):
        k = qk[q]
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) >> 1
            if st[mid] < table or (st[mid] == table and sk[mid] < k):
                lo = mid + 1
            else:
                hi = mid
        if lo < n and st[lo] == table and sk[lo] == k:
            r = sp[lo]
            found[q] = True
            for c in range(width):
                out[q, c] = rec[r, c]


#: the default limit, in leaf pages of the store's rows: a commit copies each leaf page it
#: touches (LMDB's copy-on-write), once however many of the page's rows it writes, so its
#: cost goes with the pages touched, ``P (1 - exp(-R / P))`` for ``R`` rows spread over
#: ``P`` pages.  A commit of ``R = 3 P`` rows copies 0.32 pages a row, of ``R = 0.85 P``
#: (16k rows of a 960k-row store) 0.67: measured in ``scripts/bench_pipeline.py``'s Zipf
#: disk configuration, the writer child's CPU a step 2.5-3.0 -> 1.2-1.6 ms.
COMBINE_PAGES = 3
COMBINE_MIN = 16384  # rows held at least (the limit before it followed the store's size)
COMBINE_MAX_BYTES = 64 << 20  # records held at most: 64 MiB
LEAF_BYTES = 4080  # a 4 KiB LMDB leaf page less its header
NODE_BYTES = 16  # each row's node header and 8-byte key in a leaf page


def default_limit(rows: list[int | None], widths: list[int]) -> int:
    """The default ``write_combine`` of a store whose tables have ``rows`` rows (None: ids
    unbounded, rows unknown: it adds none) and records of ``widths`` float32:
    ``COMBINE_PAGES`` x the leaf pages its rows fill in LMDB, at least ``COMBINE_MIN``
    rows and at most ``COMBINE_MAX_BYTES`` of records (beyond, a commit touches few of a
    page's rows however many it holds)."""
    pages = sum(n * (4 * w + NODE_BYTES) / LEAF_BYTES for n, w in zip(rows, widths) if n)
    most = COMBINE_MAX_BYTES // (4 * max(widths))  # (a store has a table, each width >= 1)
    return int(max(COMBINE_MIN, min(COMBINE_PAGES * pages, most)))


class WriteCombiner:
    """Dirty rows written down by eviction, held until ``limit`` records are.

    Not thread-safe: its disk tier's callers hold the store's lock.

    Args:
        limit: records held at most (a row written down twice holds two until the
            commit); :meth:`DiskTier.enqueue_rows` commits before a write-back would
            pass it.
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.rec = np.empty((0, 0), np.float32)  # records appended (kept allocated across commits)
        self.clear()

    def clear(self) -> None:
        """Forget every row held (after their commit, or when LMDB is emptied)."""
        self.t = np.empty(0, np.int64)  # the rows held, sorted by (table, id)
        self.k = np.empty(0, np.int64)
        self.p = np.empty(0, np.int64)  # each row's newest record in self.rec
        self.n = 0  # records appended (a row's older records included)
        self.widths: dict[int, int] = {}  # each table's record width, as written

    @property
    def rows(self) -> int:
        """Rows held (each once)."""
        return int(self.t.size)

    def room(self, m: int) -> bool:
        """Whether ``m`` more records fit under the limit."""
        return self.n + m <= self.limit

    def put(self, t: np.ndarray, k: np.ndarray, rec: np.ndarray, widths: list[int]) -> None:
        """Hold rows ``(t, k)`` (int64 ``[m]``) with records ``rec`` (float32 ``[m, W]``,
        the first ``widths[t]`` columns meaningful); of a row given twice the last wins."""
        m = t.size
        if m == 0:
            return
        t, k = np.ascontiguousarray(t, np.int64), np.ascontiguousarray(k, np.int64)
        order = np.lexsort((k, t))  # stable: equal rows keep their order, the last is the newest
        st, sk = t[order], k[order]
        last = np.ones(m, dtype=bool)
        last[:-1] = (st[1:] != st[:-1]) | (sk[1:] != sk[:-1])
        if not last.all():
            order, st, sk = order[last], st[last], sk[last]
        W = rec.shape[1]
        if self.n + m > self.rec.shape[0] or W > self.rec.shape[1]:
            rows = min(max(2 * self.rec.shape[0], self.n + m, 64), max(self.limit, self.n + m))
            grown = np.zeros((rows, max(W, self.rec.shape[1])), np.float32)
            grown[:self.n, :self.rec.shape[1]] = self.rec[:self.n]
            self.rec = grown
        self.rec[self.n:self.n + m, :W] = rec
        pos = order + self.n
        self.n += m
        self.t, self.k, self.p = merge_runs(self.t, self.k, self.p, st, sk, pos)
        for ti in np.unique(st).tolist():
            self.widths[ti] = widths[ti]

    def lookup(self, table: int, ids: np.ndarray, width: int, found: np.ndarray, out: np.ndarray) -> None:
        """Set ``found``/``out`` (``[n]``, ``[n, width]``) for those of table ``table``'s
        ``ids`` (int64 ``[n]``) held here (newer than LMDB's records)."""
        if self.t.size == 0 or len(ids) == 0:
            return
        fill_held(self.t, self.k, self.p, self.rec, np.int64(table), np.ascontiguousarray(ids, np.int64), width,
                  found, out)

    def _runs(self) -> list[tuple[int, int, int]]:
        """``(table, start, end)`` of each table's run of the rows held."""
        if self.t.size == 0:
            return []
        cut = np.flatnonzero(self.t[1:] != self.t[:-1]) + 1
        starts, ends = np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [self.t.size])).tolist()
        return [(int(self.t[a]), a, b) for a, b in zip(starts, ends)]

    def keys(self) -> list[tuple[int, np.ndarray]]:
        """The rows held as ``(table, ids sorted)`` groups (no records gathered)."""
        return [(ti, self.k[a:b]) for ti, a, b in self._runs()]

    def groups(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The rows held as ``(table, ids sorted, records at the table's width)`` groups."""
        return [(ti, self.k[a:b], self.rec[self.p[a:b], :self.widths[ti]]) for ti, a, b in self._runs()]
