"""LMDB errors typed by cause: a full disk, an I/O error of the OS, a corrupt store.

LMDB hands back the OS's errno for a failed ``read``/``pwrite``/``fsync`` (EIO for a
failing disk) and its own negative codes for what it finds wrong in the file
(``MDB_CORRUPTED``, ``MDB_PAGE_NOTFOUND``, ...).  :func:`typed` maps one to
:class:`DiskFullError`, :class:`StoreIOError` (with the errno) or
:class:`StoreFormatError`, so an I/O error never tells the user their store is corrupt.
:func:`retry_read` retries a read that failed with an I/O error (a read changes nothing,
and a transient error, e.g. of a network mount, often clears).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

import lmdb

from ..errors import DiskFullError, HierMemError, StoreFormatError, StoreIOError

T = TypeVar("T")
READ_ATTEMPTS = 3  # a failed read is tried this many times in all
RETRY_PAUSE = 0.01  # seconds before the first retry (doubled each time)

# errors of the disk or filesystem that LMDB passes on (by errno; a message naming one of
# them is read the same way); others (EISDIR, EACCES, ...) say what the path is, not an I/O failure
_IO_ERRNOS = (errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ENXIO, errno.ENODEV, errno.ENOMEM,
              errno.ESTALE, errno.ETIMEDOUT, errno.EFBIG, errno.EDQUOT, errno.ENOSPC)
_CORRUPT = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
            lmdb.BadValsizeError)


def _is_enospc(e: BaseException) -> bool:
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)


def _disk_full(path: Path, e: BaseException, need: int = 0) -> bool:
    """ENOSPC, or an I/O error (LMDB reports a short write as EIO) with the disk full."""
    if _is_enospc(e):
        return True
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize <= need + (1 << 16)


def os_errno(e: BaseException) -> int | None:
    """The OS errno behind an LMDB (or OS) error, or None where it is LMDB's own code."""
    code = getattr(e, "errno", None) or getattr(e, "code", None)
    if isinstance(code, int) and code > 0:
        return code if code in _IO_ERRNOS else None
    msg = str(e)
    for n in _IO_ERRNOS:
        if os.strerror(n) in msg:
            return n
    return None


def typed(path, e: BaseException, doing: str, need: int = 0) -> HierMemError:
    """The typed error for LMDB error ``e`` met while ``doing`` (e.g. "read") on ``path``."""
    if isinstance(e, HierMemError):
        return e
    n = os_errno(e)
    if n in (errno.ENOSPC, errno.EDQUOT) or (n is not None and _disk_full(Path(path), e, need)):
        return DiskFullError(errno.ENOSPC, f"{path}: disk full; the {doing} was not made ({e})")
    if n is not None:
        return StoreIOError(n, f"{path}: I/O error during LMDB {doing} ({e}); the store is not known to "
                               "be corrupt: check the disk and retry", path)
    if isinstance(e, _CORRUPT):
        return StoreFormatError(path, f"corrupt store: LMDB {doing} failed: {e}")
    return HierMemError(f"{path}: LMDB {doing} failed: {e}")


def retry_read(path, fn: Callable[[], T], doing: str = "read", attempts: int = READ_ATTEMPTS) -> T:
    """``fn()``, retried on an OS I/O error (``attempts`` in all), else the typed error."""
    pause = RETRY_PAUSE
    for i in range(attempts):
        try:
            return fn()
        except lmdb.Error as e:
            err = typed(path, e, doing)
            if not isinstance(err, StoreIOError) or i == attempts - 1:
                raise err from e
        time.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")
