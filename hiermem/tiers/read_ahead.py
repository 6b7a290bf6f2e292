"""Read-ahead of the disk tier: the records of an upcoming batch, read on another thread.

:meth:`ReadAhead.read` reads the records of an upcoming batch on the caller's thread
(another than the training loop's), outside the store's lock, through the disk tier's
batched read; the disk tier's ``read`` then takes them from this cache.  A cached record
is exactly LMDB's current value: every write drops the cached copies of the keys it
writes (:meth:`ReadAhead.written`), and a read-ahead drops the keys written while it
read (a log kept only while one is in flight).  Guarded by its own condition.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import lmdb
import numpy as np

from ..core.jit import kernel
from ..errors import StoreFormatError
from .records import lower_bound


@kernel
def take_live(cids, clive, cfound, crec, ids, got, found, out):
    """For each of ``ids`` (uint64) not ``got`` yet, its live record among the sorted
    ``cids`` (a chunk: ``clive``/``cfound`` bool, ``crec`` float32 ``[m, width]``), by
    binary search: into ``found``/``out`` at the id's position, ``got`` set, the chunk's
    copy no longer live.  Returns how many it took."""
    m, width, n = cids.size, crec.shape[1], 0
    for q in range(ids.size):
        if got[q]:
            continue
        x = ids[q]
        lo = lower_bound(cids, x)
        if lo < m and cids[lo] == x and clive[lo]:
            found[q] = cfound[lo]
            for c in range(width):
                out[q, c] = crec[lo, c]
            clive[lo] = False  # the row is resident now: its next read is after a write
            got[q] = True
            n += 1
    return n

@dataclass
class _Ahead:
    """Read-ahead records of one table's keys: ``ids`` sorted, ``live`` until used or
    overwritten; ``found`` False where LMDB had no record (the row was never written)."""

    table: int
    ids: np.ndarray
    found: np.ndarray
    rec: np.ndarray
    live: np.ndarray

    def drop(self, ids: np.ndarray) -> None:
        """Mark ``ids`` (uint64, any order) not live: one binary search each."""
        if not len(self.ids) or not len(ids):
            return
        j = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        self.live[j[self.ids[j] == ids]] = False


AHEAD_BATCHES = 4  # read-ahead batches kept (older ones are dropped unused)


class ReadAhead:
    """The read-ahead cache of one disk tier.

    Args:
        read: the disk tier's batched read: ``[(table, sorted distinct uint64 ids,
            width)] -> [(found bool[n], records float32[n, width])]``, one snapshot.
    """

    def __init__(self, read: Callable[[list], list]):
        self._read = read
        self._cv = threading.Condition()
        self._batches: list[dict[int, _Ahead]] = []  # per read-ahead batch, its tables' chunks by table
        self._open: int | None = None  # token of the read-ahead in flight
        self._seq = 0
        self._active = 0
        self._wlog: list[tuple[int, np.ndarray]] = []  # (table, ids) written while a read-ahead is open
        self.rows = 0  # records read ahead and kept
        self.hits = 0  # reads served from them

    def __len__(self) -> int:
        """Read-ahead batches cached."""
        return len(self._batches)

    def lookup(self, table: int, ids: np.ndarray, found: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill what the cache holds of ``ids`` (distinct) into ``found``/``out``; returns
        which it held (those records are used: not served again)."""
        got = np.zeros(len(ids), dtype=bool)
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        n = 0
        with self._cv:
            for batch in reversed(self._batches):  # the newest read first
                c = batch.get(table)
                if c is None or not len(c.ids):
                    continue
                n += take_live(c.ids, c.live, c.found, c.rec, ids, got, found, out)
                if n == len(ids):
                    break
            self.hits += n
        return got

    def begin(self) -> int:
        """Open a read-ahead (the caller holds the store's lock, so no write is between
        its residency check and this); returns the token for :meth:`read`."""
        with self._cv:
            self._active += 1
            self._seq += 1  # a later read-ahead's open closes this one (it keeps nothing)
            self._open = self._seq
            self._wlog = []
            return self._seq

    def read(self, groups: list[tuple[int, np.ndarray, int]], token: int, keep: int | None = None) -> int:
        """Read ``(table, distinct ids, width)`` groups into the cache, without the store's
        lock; returns the records kept.  Best effort: an LMDB error keeps nothing (the
        real read reports it)."""
        try:
            groups = [(table, np.sort(np.asarray(ids).astype(np.uint64)), width) for table, ids, width in groups]
            try:
                chunks = {table: _Ahead(table, ids, found, rec, np.ones(len(ids), dtype=bool))
                          for (table, ids, _), (found, rec) in zip(groups, self._read(groups))}
            except (lmdb.Error, StoreFormatError):
                chunks = {}
            with self._cv:
                if self._open != token:  # cleared, or another read-ahead opened since
                    return 0
                for table, written in self._wlog:  # written while this one read: stale
                    c = chunks.get(table)
                    if c is not None:
                        c.drop(written)
                self._open = None
                self._wlog = []
                if chunks:
                    self._batches.append(chunks)
                    del self._batches[:-(keep or AHEAD_BATCHES)]
                kept = sum(int(c.live.sum()) for c in chunks.values())
                self.rows += kept
                return kept
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def written(self, groups: list[tuple[int, np.ndarray]]) -> None:
        """Keys just committed (or queued to be): their cached copies are stale."""
        with self._cv:
            for table, ids in groups:
                ids = np.asarray(ids).astype(np.uint64)
                for batch in self._batches:
                    c = batch.get(table)
                    if c is not None:
                        c.drop(ids)
                if self._open is not None:
                    self._wlog.append((table, ids))

    @contextmanager
    def idle(self, timeout: float = 60):
        """Hold the cache with no read-ahead reading (one in flight finishes first, none
        starts meanwhile): no LMDB transaction of it is open (a map resize needs that)."""
        with self._cv:
            self._cv.wait_for(lambda: self._active == 0, timeout=timeout)
            yield

    def clear(self, wait: bool = False) -> None:
        """Forget every record (``wait``: after a read-ahead still reading finishes)."""
        with self._cv:
            if wait:
                self._cv.wait_for(lambda: self._active == 0, timeout=60)
            self._batches = []
            self._open = None
            self._wlog = []
