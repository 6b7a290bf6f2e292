"""Write-behind of the disk tier: eviction write-backs committed by a writer thread.

With ``write_behind``, eviction write-backs (:meth:`WriteBehind.enqueue`) are committed
by a writer thread, in order, at most ``WRITE_BEHIND_BATCHES`` behind; until committed a
row's record is in that queue, and the disk tier's ``read`` takes it from there.  Every
other write, and :meth:`WriteBehind.drain` (flush, checkpoint, close), waits for the
queue first.  A failed background commit keeps its batch queued; the next call that
writes or drains retries it on the caller's thread and raises the typed error there.
Guarded by ``_wq_cv``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .lmdb_process import LmdbProcess, LmdbProcessError

WRITE_BEHIND_BATCHES = 2  # write-back batches queued at most (an enqueue beyond waits)


@dataclass
class _Queued:
    """One queued write-back: per table, ids sorted (in key order) with their records."""

    groups: list[tuple[int, np.ndarray, np.ndarray]]
    meta_raw: bytes | None
    nbytes: int



class WriteBehind:
    """The write-behind queue of :class:`~hiermem.tiers.disk.DiskTier` (a mixin)."""

    def _init_write_behind(self, write_behind: bool) -> None:
        self.write_behind = bool(write_behind)
        self._wq: deque[_Queued] = deque()
        self._wq_cv = threading.Condition()
        self._wq_failed = False  # the writer stopped on an error: callers retry
        self._wq_stop = False
        self._writer: threading.Thread | None = None

    def enqueue(self, groups: Iterable[tuple[int, np.ndarray, np.ndarray]], meta: dict | None = None) -> int:
        """Queue a write-back for the writer thread (``write_behind``; else :meth:`write`).

        Waits while ``WRITE_BEHIND_BATCHES`` are queued.  Returns the bytes of records.

        Raises:
            DiskFullError, HierMemError: an earlier queued write failed and failed again
                when retried here; nothing of this call was queued.
        """
        if not self.write_behind:
            return self.write(groups, meta=meta)
        q = self._prepare(groups, meta)
        while True:
            self._recover()
            with self._wq_cv:
                self._wq_cv.wait_for(lambda: len(self._wq) < WRITE_BEHIND_BATCHES or self._wq_failed)
                if self._wq_failed:
                    continue
                self._wq.append(q)
                self._wq_cv.notify_all()
                break
        self._written([(t, ids) for t, ids, _ in q.groups])  # LMDB's copies are going stale
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="hiermem-lmdb-writer", daemon=True)
            self._writer.start()
        self.bytes_written += q.nbytes
        return q.nbytes

    def _write_loop(self) -> None:
        while True:
            with self._wq_cv:
                self._wq_cv.wait_for(lambda: self._wq_stop or (self._wq and not self._wq_failed))
                if self._wq_stop:
                    return
                q = self._wq[0]
            t0 = time.perf_counter()
            try:  # no map growth here: that needs every reader out (the caller's retry does it)
                proc = self._proc(write=True)
                if proc is not None:
                    try:
                        self._proc_write(proc, q)
                    except LmdbProcessError as e:
                        self._proc_failed(proc, e)
                        raise
                else:
                    with self.env.begin(write=True) as txn:
                        self._txn_body(q)(txn)
            except BaseException:
                with self._wq_cv:
                    self._wq_failed = True
                    self._wq_cv.notify_all()
                continue
            self._committed(q, t0)

    @staticmethod
    def _proc_write(proc: LmdbProcess, q: _Queued) -> None:
        """Commit a queued write-back in the writer thread's I/O process."""
        proc.write(q.groups, q.meta_raw)

    def _committed(self, q: _Queued, t0: float) -> None:
        self._written([(t, ids) for t, ids, _ in q.groups])  # a read-ahead open meanwhile drops them
        with self._ahead_cv:
            self.write_seconds.observe(time.perf_counter() - t0)
        with self._wq_cv:
            self._wq.popleft()
            self._wq_cv.notify_all()

    def _recover(self) -> None:
        """After a failed background commit: commit the queue here, in order (growing
        the map if it was full), or raise the typed error with the queue kept."""
        with self._wq_cv:
            if not self._wq_failed:
                return
        while True:
            with self._wq_cv:
                if not self._wq:
                    self._wq_failed = False
                    self._wq_cv.notify_all()
                    return
                q = self._wq[0]
            t0 = time.perf_counter()
            self._write_txn(self._txn_body(q), q.nbytes)
            self._committed(q, t0)

    def drain(self) -> None:
        """Wait until every queued write-back is committed (retrying a failed one here).

        Raises:
            DiskFullError, HierMemError: a queued write failed again; it stays queued.
        """
        while True:
            with self._wq_cv:
                self._wq_cv.wait_for(lambda: not self._wq or self._wq_failed)
                if not self._wq:
                    return
            self._recover()

    @property
    def queued(self) -> int:
        """Rows in queued write-backs."""
        with self._wq_cv:
            return sum(len(ids) for q in self._wq for _, ids, _ in q.groups)
