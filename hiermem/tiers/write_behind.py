"""Write-behind of the disk tier: eviction write-backs committed by a writer thread.

With ``write_behind``, eviction write-backs (the disk tier's ``enqueue``, into
:meth:`WriteQueue.put`) are committed by a writer thread, in order, at most
``WRITE_BEHIND_BATCHES`` behind; until committed a row's record is in that queue, and
the disk tier's ``read`` takes it from there (:meth:`WriteQueue.snapshot`).  Every other
write, and :meth:`WriteQueue.drain` (flush, checkpoint, close), waits for the queue
first.  A failed background commit keeps its batch queued; the next call that writes or
drains retries it on the caller's thread and raises the typed error there.  Guarded by
its own condition; the commits themselves are the disk tier's (callbacks).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.jit import kernel
from .priority import lower_this_thread
from .records import lower_bound

WRITE_BEHIND_BATCHES = 2  # write-back batches queued at most (an enqueue beyond waits)


@dataclass
class _Queued:
    """One queued write-back: per table, ids sorted (in key order) with their records."""

    groups: list[tuple[int, np.ndarray, np.ndarray]]
    meta_raw: bytes | None
    nbytes: int


@kernel
def take_queued(qids, qrec, ids, width, found, out):
    """For each of ``ids`` (uint64, any order) among one queued group's sorted ``qids``
    (uint64) with records ``qrec`` (float32 ``[m, >= width]``): ``found`` set and ``out``
    its record's first ``width`` columns, by binary search, in place (a later group's
    call then overwrites an older one's: the newest wins)."""
    m = qids.size
    for q in range(ids.size):
        x = ids[q]
        lo = lower_bound(qids, x)
        if lo < m and qids[lo] == x:
            found[q] = True
            for c in range(width):
                out[q, c] = qrec[lo, c]


def queued_by_table(queued: list[_Queued]) -> dict[int, list[tuple[np.ndarray, np.ndarray]]]:
    """Per table, the ``(ids, records)`` of the queued batches ``queued`` (a
    :meth:`WriteQueue.snapshot`), oldest first, empty groups left out."""
    out: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for q in queued:
        for t, qids, qrec in q.groups:
            if len(qids):
                out.setdefault(t, []).append((qids, qrec))
    return out


class WriteQueue:
    """The write-behind queue of one disk tier.

    Args:
        commit: commits a queued batch on the writer thread (raises on failure).
        recover: commits a batch whose background commit failed, on the caller's thread
            (raises the typed error; the batch stays queued).
        committed: ``(batch, t0)`` after either commit, before the batch leaves the
            queue (``t0``: when its commit began).
    """

    def __init__(self, commit: Callable[[_Queued], None], recover: Callable[[_Queued], None],
                 committed: Callable[[_Queued, float], None]):
        self._commit, self._recover_one, self._committed = commit, recover, committed
        self._q: deque[_Queued] = deque()
        self._cv = threading.Condition()
        self._failed = False  # the writer stopped on an error: callers retry
        self._stop = False
        self._writer: threading.Thread | None = None

    def put(self, q: _Queued) -> None:
        """Queue a batch for the writer thread (started on first use); waits while
        ``WRITE_BEHIND_BATCHES`` are queued.

        Raises:
            DiskFullError, HierMemError: an earlier queued write failed and failed again
                when retried here; ``q`` was not queued.
        """
        while True:
            self._recover()
            with self._cv:
                self._cv.wait_for(lambda: len(self._q) < WRITE_BEHIND_BATCHES or self._failed)
                if self._failed:
                    continue
                self._q.append(q)
                self._cv.notify_all()
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, name="hiermem-lmdb-writer",
                                                    daemon=True)
                    self._writer.start()
                return

    def _write_loop(self) -> None:
        lower_this_thread()  # background I/O: the training thread first
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or (self._q and not self._failed))
                if self._stop:
                    return
                q = self._q[0]
            t0 = time.perf_counter()
            try:  # no map growth here: that needs every reader out (the caller's retry does it)
                self._commit(q)
            except BaseException:
                with self._cv:
                    self._failed = True
                    self._cv.notify_all()
                continue
            self._done(q, t0)

    def _done(self, q: _Queued, t0: float) -> None:
        self._committed(q, t0)
        with self._cv:
            self._q.popleft()
            self._cv.notify_all()

    def _recover(self) -> None:
        """After a failed background commit: commit the queue here, in order, or raise
        the typed error with the queue kept."""
        with self._cv:
            if not self._failed:
                return
        while True:
            with self._cv:
                if not self._q:
                    self._failed = False
                    self._cv.notify_all()
                    return
                q = self._q[0]
            t0 = time.perf_counter()
            self._recover_one(q)
            self._done(q, t0)

    def drain(self) -> None:
        """Wait until every queued batch is committed (retrying a failed one here).

        Raises:
            DiskFullError, HierMemError: a queued write failed again; it stays queued.
        """
        while True:
            with self._cv:
                self._cv.wait_for(lambda: not self._q or self._failed)
                if not self._q:
                    return
            self._recover()

    def snapshot(self) -> list[_Queued]:
        """The queued batches, oldest first (a reader takes their records: the newest
        queued record of a row is its value)."""
        with self._cv:
            return list(self._q)

    @property
    def rows(self) -> int:
        """Rows in queued batches."""
        with self._cv:
            return sum(len(ids) for q in self._q for _, ids, _ in q.groups)

    def stop(self, timeout: float = 60) -> None:
        """Stop the writer thread (batches still queued are dropped: drain first)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=timeout)
