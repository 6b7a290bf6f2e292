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

import threading

from . import lmdb_process
from .lmdb_process import LmdbProcess, LmdbProcessError


class IOProcesses:
    """The I/O processes of :class:`~hiermem.tiers.disk.DiskTier` (a mixin)."""

    def _init_io_processes(self, io_process: bool, sync: bool) -> None:
        self.io_process = bool(io_process) and lmdb_process.supported()
        self._sync = sync
        self._io = threading.local()
        self._io_lock = threading.Lock()
        self._io_procs: list[LmdbProcess] = []
        self.io_failures = 0  # child processes that failed to start or died (in-thread I/O meanwhile)

    def _proc(self, write: bool) -> LmdbProcess | None:
        """This thread's I/O process (started on first use), or None: do the I/O here."""
        if not self.io_process:
            return None
        p = getattr(self._io, "proc", None)
        if p is not None and p.alive:
            return p
        if p is not None:
            self._proc_failed(p, None)
        with self._io_lock:
            for q in [q for q in self._io_procs if not q.alive]:  # their threads ended
                self._io_procs.remove(q)
                q.close()
            if not self.io_process:
                return None
        try:
            p = LmdbProcess(self.path, self.map_size, write=write, sync=self._sync,
                            writemap=write and self.writemap, max_dbs=self._max_dbs)
        except (LmdbProcessError, OSError):
            self._proc_failed(None, None)
            return None
        with self._io_lock:
            self._io_procs.append(p)
        self._io.proc = p
        return p

    @property
    def io_processes(self) -> int:
        """I/O processes running now (one per background thread that used one)."""
        with self._io_lock:
            return sum(p.alive for p in self._io_procs)

    def _proc_failed(self, p: LmdbProcess | None, e: LmdbProcessError | None) -> None:
        """Drop a failed or finished process; after three failures, in-thread I/O only."""
        if p is not None:
            self._io.proc = None
            with self._io_lock:
                if p in self._io_procs:
                    self._io_procs.remove(p)
            p.close()
        if e is None or not e.map_full:  # a full map: a new process opens the grown map
            with self._io_lock:
                self.io_failures += 1
                if self.io_failures >= 3:
                    self.io_process = False
