"""The disk tier's background I/O processes: one per background thread doing LMDB work.

With ``io_process`` (the store's default on Linux) the background threads (the writer,
and each read-ahead thread) hand their LMDB work to a child process each
(:mod:`hiermem.tiers.lmdb_process`): py-lmdb holds the GIL while it works, so done on
the thread itself it would stop the training thread; the protocols of read-ahead and
write-behind are unchanged (a child commits a queued batch, then the thread drops it
from the queue).  A child that dies or fails is replaced, and after three failures the
threads do the I/O themselves.
"""

from __future__ import annotations

import os
import threading

from . import lmdb_process
from .lmdb_process import LmdbProcess, LmdbProcessError

MAX_FAILURES = 3  # children that failed to start or died before the threads do their own I/O


class IOProcesses:
    """The I/O processes of one disk tier (an LMDB environment at ``path``), one per
    thread that asks (:meth:`get`), each started on first use.  Thread-safe.

    Args:
        path: the environment's directory.
        enabled: use processes at all (and only where :func:`lmdb_process.supported`).
        sync: children commit with fsync.
        max_dbs: the environment's ``max_dbs``.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool, sync: bool, max_dbs: int):
        self.path = path
        self.enabled = bool(enabled) and lmdb_process.supported()
        self._sync = sync
        self._max_dbs = max_dbs
        self._local = threading.local()
        self._lock = threading.Lock()
        self._procs: list[LmdbProcess] = []
        self.failures = 0  # children that failed to start or died (in-thread I/O meanwhile)

    def get(self, write: bool, map_size: int, writemap: bool) -> LmdbProcess | None:
        """This thread's I/O process (started on first use over a map of ``map_size``;
        ``write``: a writer, through the shared map when ``writemap``), or None: do the
        I/O on the thread."""
        if not self.enabled:
            return None
        p = getattr(self._local, "proc", None)
        if p is not None and p.alive:
            return p
        if p is not None:
            self.failed(p, None)
        with self._lock:
            for q in [q for q in self._procs if not q.alive]:  # their threads ended
                self._procs.remove(q)
                q.close()
            if not self.enabled:
                return None
        try:
            p = LmdbProcess(self.path, map_size, write=write, sync=self._sync, writemap=write and writemap,
                            max_dbs=self._max_dbs)
        except (LmdbProcessError, OSError):
            self.failed(None, None)
            return None
        with self._lock:
            self._procs.append(p)
        self._local.proc = p
        return p

    def failed(self, p: LmdbProcess | None, e: LmdbProcessError | None) -> None:
        """Drop a failed or finished process (this thread's); count a failure unless it
        only found the map full (a new process opens the grown map); after
        ``MAX_FAILURES``, in-thread I/O only."""
        if p is not None:
            self._local.proc = None
            with self._lock:
                if p in self._procs:
                    self._procs.remove(p)
            p.close()
        if e is None or not e.map_full:
            with self._lock:
                self.failures += 1
                if self.failures >= MAX_FAILURES:
                    self.enabled = False

    @property
    def running(self) -> int:
        """Processes alive now."""
        with self._lock:
            return sum(p.alive for p in self._procs)

    def processes(self) -> list[LmdbProcess]:
        """The processes started and not yet dropped (a copy)."""
        with self._lock:
            return list(self._procs)

    def close(self) -> None:
        """Stop every process; later :meth:`get` calls return None."""
        with self._lock:
            procs, self._procs = self._procs, []
            self.enabled = False
        for p in procs:
            p.close()
