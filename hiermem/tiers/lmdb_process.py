"""A child process doing a disk tier's background LMDB I/O (read-ahead, write-behind).

py-lmdb holds the GIL through its batched calls, so a read-ahead or write-behind thread
that called LMDB itself would stop the training thread for as long as LMDB works: the
threads would take turns, not overlap.  :class:`LmdbProcess` runs ``_lmdb_server.py``
(lmdb and numpy only) and hands it whole batches over a pipe; the calling thread waits
on the pipe with the GIL released.  Used only from the disk tier's background threads
(one process per thread that uses it); the store's own synchronous I/O stays in-process.

The child is the C build of the server (``lmdb_server.c``, :mod:`.native`) where it
builds, else ``_lmdb_server.py``; both speak one protocol.  A C child that cannot open
the store (say, a liblmdb whose lock format differs from py-lmdb's) is not tried again in
this process: the Python child runs instead.
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
from . import native
from .priority import lower_process

SERVER = Path(__file__).with_name("_lmdb_server.py")
_HDR = struct.Struct("<cQ")
_REPLY = struct.Struct("<BQ")
START_TIMEOUT = 30.0
_native_failed: list[str] = []  # why the C child failed to start here (then: Python children)


class LmdbProcessError(Exception):
    """The I/O process failed a request (``map_full`` when LMDB's map is full) or is gone."""

    def __init__(self, message: str, map_full: bool = False, gone: bool = False):
        super().__init__(message)
        self.map_full = map_full
        self.gone = gone


def supported() -> bool:
    """Where the I/O process dies with the thread that starts it (Linux)."""
    return sys.platform.startswith("linux")


class LmdbProcess:
    """One I/O process on the LMDB environment at ``path``.

    Args:
        path: the environment's directory (already created, with its databases).
        map_size: the map size to open with (a larger one set since is adopted).
        write: allow write transactions (else the environment is opened read-only).
        sync: fsync every commit.
        writemap: write through the shared map (``MDB_WRITEMAP``; ``write`` only): the
            caller has allocated the file up to ``map_size``, the current map size.
        max_dbs: LMDB's ``max_dbs`` (room for every table's database).

    Not thread-safe: one thread uses it (and, on Linux, the process is killed when that
    thread ends).

    Raises:
        LmdbProcessError: the process did not start or could not open the store.
    """

    def __init__(self, path: str | os.PathLike, map_size: int, write: bool, sync: bool, writemap: bool = False,
                 max_dbs: int = 32):
        args = [str(path), str(int(map_size)), "w" if write else "r", "1" if sync else "0", str(os.getpid()),
                "1" if write and writemap else "0", str(int(max_dbs))]
        exe = None if _native_failed else native.server()
        failed = None
        if exe is not None:
            try:
                self._start([str(exe)] + args)
                self.native = True
                return
            except LmdbProcessError as e:
                if e.gone or native.choice() == "native":
                    raise
                failed = str(e)
        self._start([sys.executable, str(SERVER)] + args)
        self.native = False  # the Python child (py-lmdb)
        if failed is not None:  # the C child cannot open a store py-lmdb opens: Python from now on
            _native_failed.append(failed)

    def _start(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, close_fds=True)
        lower_process(self.proc.pid)  # background I/O: the training thread first
        try:
            self._call(None, b"", timeout=START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _recv(self, n: int, timeout: float | None) -> bytes:
        fd, buf = self.proc.stdout.fileno(), bytearray()
        while len(buf) < n:
            if timeout is not None and not select.select([fd], [], [], timeout)[0]:
                raise LmdbProcessError("the LMDB I/O process did not answer in time", gone=True)
            chunk = os.read(fd, min(n - len(buf), 1 << 22))
            if not chunk:
                raise LmdbProcessError("the LMDB I/O process exited", gone=True)
            buf += chunk
        return bytes(buf)

    def _send(self, op: bytes, payload: bytes) -> None:
        try:
            self.proc.stdin.write(_HDR.pack(op, len(payload)))
            self.proc.stdin.write(payload)
        except (OSError, ValueError) as e:  # a broken pipe: the process is gone
            raise LmdbProcessError(f"the LMDB I/O process is gone: {e}", gone=True) from e

    def _wait(self, timeout: float | None = None) -> bytes:
        """The reply to the request sent last."""
        try:
            status, n = _REPLY.unpack(self._recv(_REPLY.size, timeout))
            body = self._recv(n, timeout) if n else b""
        except (OSError, ValueError) as e:
            raise LmdbProcessError(f"the LMDB I/O process is gone: {e}", gone=True) from e
        if status == 1:
            raise LmdbProcessError("LMDB map full", map_full=True)
        if status != 0:
            raise LmdbProcessError(body.decode(errors="replace"))
        return body

    def _call(self, op: bytes | None, payload: bytes, timeout: float | None = None) -> bytes:
        if op is not None:
            self._send(op, payload)
        return self._wait(timeout)

    def read(self, groups: list[tuple[int, np.ndarray, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(table, sorted distinct uint64 ids, width)`` groups -> per group ``(found
        bool[n], records [n, width])``."""
        parts = [struct.pack("<I", len(groups))]
        for table, ids, width in groups:
            parts += [struct.pack("<IIQ", table, width, len(ids)), np.ascontiguousarray(ids, dtype=np.uint64).tobytes()]
        raw = self._call(b"R", b"".join(parts))
        out, off = [], 0
        for _, ids, width in groups:
            n = len(ids)
            found = np.frombuffer(raw, dtype=np.uint8, count=n, offset=off).astype(bool)
            off += n
            rec = np.frombuffer(raw, dtype="<f4", count=n * width, offset=off).reshape(n, width).copy()
            off += n * width * 4
            out.append((found, rec))
        return out

    def write(self, groups: list[tuple[int, np.ndarray, np.ndarray]], meta: bytes | None) -> None:
        """Commit ``(table, sorted distinct uint64 ids, float32 records [n, w])`` groups and
        ``meta`` in one transaction (every table's database exists already)."""
        self.begin_write(groups, meta)
        self._wait()

    def begin_write(self, groups: list[tuple[int, np.ndarray, np.ndarray]], meta: bytes | None) -> None:
        """Send :meth:`write`'s request without waiting for its commit (then ``_wait()``)."""
        parts = [struct.pack("<I", len(groups))]
        for table, ids, rec in groups:
            rec = np.ascontiguousarray(rec, dtype="<f4")
            parts += [struct.pack("<IIQ", table, rec.shape[1] * 4, len(ids)),
                      np.ascontiguousarray(ids, dtype=np.uint64).tobytes(), rec.tobytes()]
        parts += [struct.pack("<I", len(meta or b"")), meta or b""]
        self._send(b"W", b"".join(parts))

    def close(self) -> None:
        """Stop the process (idempotent)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(_HDR.pack(b"Q", 0))
            except OSError:
                pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
