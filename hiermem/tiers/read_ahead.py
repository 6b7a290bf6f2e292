"""Read-ahead of the disk tier: the records of an upcoming batch, read on another thread.

:meth:`ReadAhead.read_ahead` reads the records of an upcoming batch on another thread,
outside the store's lock; the disk tier's ``read`` then takes them from that cache.  A
cached record is exactly LMDB's current value: every write drops the cached copies of
the keys it writes, and a read-ahead drops the keys written while it read (a log kept
only while one is in flight).  Guarded by ``_ahead_cv``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import lmdb
import numpy as np

from ..errors import StoreFormatError
from .lmdb_process import LmdbProcessError
from .records import key_list

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
    """The read-ahead cache of :class:`~hiermem.tiers.disk.DiskTier` (a mixin)."""

    def _init_read_ahead(self) -> None:
        self._ahead_cv = threading.Condition()
        self._ahead: list[list[_Ahead]] = []  # per read-ahead batch, its tables' chunks
        self._ahead_open: int | None = None  # token of the read-ahead in flight
        self._ahead_seq = 0
        self._ahead_active = 0
        self._wlog: list[tuple[int, np.ndarray]] = []  # (table, ids) written while a read-ahead is open
        self.ahead_rows = 0  # records read ahead and kept
        self.ahead_hits = 0  # reads served from them

    def _from_ahead(self, table: int, ids: np.ndarray, found: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill what the read-ahead cache holds of ``ids`` (distinct); which it held."""
        got = np.zeros(len(ids), dtype=bool)
        ids = ids.astype(np.uint64, copy=False)
        with self._ahead_cv:
            for batch in reversed(self._ahead):
                for c in batch:
                    if c.table != table or not len(c.ids):
                        continue
                    j = np.minimum(np.searchsorted(c.ids, ids), len(c.ids) - 1)
                    hit = ~got & (c.ids[j] == ids) & c.live[j]
                    if hit.any():
                        jh = j[hit]
                        found[hit] = c.found[jh]
                        out[hit] = c.rec[jh]
                        c.live[jh] = False  # the row is resident now: its next read is after a write
                        got |= hit
        self.ahead_hits += int(got.sum())
        return got

    def begin_read_ahead(self) -> int:
        """Open a read-ahead (the caller holds the store's lock, so no write is between
        its residency check and this); returns the token for :meth:`read_ahead`."""
        with self._ahead_cv:
            self._ahead_active += 1
            self._ahead_seq += 1  # a later read-ahead's open closes this one (it keeps nothing)
            self._ahead_open = self._ahead_seq
            self._wlog = []
            return self._ahead_seq

    def read_ahead(self, groups: list[tuple[int, np.ndarray, int]], token: int, keep: int | None = None) -> int:
        """Read ``(table, distinct ids, width)`` groups into the cache, without the store's
        lock; returns the records kept.  Best effort: an LMDB error keeps nothing (the
        real read reports it)."""
        try:
            chunks = []
            try:
                chunks = self._read_chunks(groups)
            except (lmdb.Error, StoreFormatError):
                chunks = []
            with self._ahead_cv:
                if self._ahead_open != token:  # cleared, or another read-ahead opened since
                    return 0
                for table, written in self._wlog:  # written while this one read: stale
                    for c in chunks:
                        if c.table == table:
                            c.drop(written)
                self._ahead_open = None
                self._wlog = []
                if chunks:
                    self._ahead.append(chunks)
                    del self._ahead[:-(keep or AHEAD_BATCHES)]
                kept = sum(int(c.live.sum()) for c in chunks)
                self.ahead_rows += kept
                return kept
        finally:
            with self._ahead_cv:
                self._ahead_active -= 1
                self._ahead_cv.notify_all()

    def _read_chunks(self, groups: list[tuple[int, np.ndarray, int]]) -> list[_Ahead]:
        """Records of ``(table, ids, width)`` groups, read by this thread's I/O process
        (or here)."""
        groups = [(table, np.sort(np.asarray(ids).astype(np.uint64)), width) for table, ids, width in groups]
        proc = self._proc(write=False)
        if proc is not None:
            t0 = time.perf_counter()
            try:
                got = proc.read(groups)
            except LmdbProcessError as e:
                self._proc_failed(proc, e)
            else:
                with self._ahead_cv:
                    self.read_seconds.observe(time.perf_counter() - t0)
                for (table, ids, _), (found, rec) in zip(groups, got):
                    self.bytes_read += int(found.sum()) * rec.shape[1] * 4
                return [_Ahead(table, ids, found, rec, np.ones(len(ids), dtype=bool))
                        for (table, ids, _), (found, rec) in zip(groups, got)]
        dbs = [self.table_database(table) for table, _, _ in groups]  # before the transaction: opening one takes its own
        chunks = []
        with self.env.begin(buffers=False) as txn:
            for (table, ids, width), db in zip(groups, dbs):
                found = np.zeros(len(ids), dtype=bool)
                rec = np.zeros((len(ids), width), dtype=np.float32)
                if db is not None and len(ids):
                    t0 = time.perf_counter()
                    res = txn.cursor(db=db).getmulti(key_list(ids))
                    with self._ahead_cv:
                        self.read_seconds.observe(time.perf_counter() - t0)
                    self.parse_records(res, table, width, ids, None, found, rec)
                chunks.append(_Ahead(table, ids, found, rec, np.ones(len(ids), dtype=bool)))
        return chunks

    def _written(self, groups: list[tuple[int, np.ndarray]]) -> None:
        """Keys just committed: their cached copies are stale."""
        with self._ahead_cv:
            for table, ids in groups:
                ids = np.asarray(ids).astype(np.uint64)
                for batch in self._ahead:
                    for c in batch:
                        if c.table == table:
                            c.drop(ids)
                if self._ahead_open is not None:
                    self._wlog.append((table, ids))

    def drop_read_ahead(self) -> None:
        """Forget every read-ahead record (a pipeline that stops reading ahead): reads and
        writes then skip the cache's lookups.  Waits for a read-ahead still reading."""
        with self._ahead_cv:
            self._ahead_cv.wait_for(lambda: self._ahead_active == 0, timeout=60)
        self._drop_ahead()

    def _drop_ahead(self) -> None:
        with self._ahead_cv:
            self._ahead = []
            self._ahead_open = None
            self._wlog = []
