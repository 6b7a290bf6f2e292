"""Map growth of the disk tier: LMDB's map doubles as it fills; with ``writemap`` every
byte of it is allocated on disk first.

With ``writemap`` (the store's default where the filesystem honours preallocation:
ext2/3/4, XFS, tmpfs), writers open the environment with ``MDB_WRITEMAP``: a commit
writes its pages into the shared map instead of copying them out with ``pwrite``, which
halves the cost of a scattered write-back.  LMDB sizes the file to the map, and a write
into a page the disk cannot back would fault (SIGBUS), so every byte of the map is
allocated first (``posix_fallocate``); a map that cannot grow for lack of room raises
:class:`DiskFullError` with nothing written, as without it.  Only the process's own
environment and the writer's child map with writes; the file never shrinks under one of
them, since each opens at the current file size and only the owning process grows it.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ..errors import DiskFullError, HierMemError

# filesystems where blocks allocated by posix_fallocate back every later write in place
# (copy-on-write filesystems such as btrfs or ZFS may still fail a write into them)
PREALLOCATING_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "tmpfs"})


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem mounted at ``path`` (from ``/proc/self/mountinfo``),
    or None where that is not known."""
    real = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5 or not right.split():
                    continue
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
    except OSError:
        return None
    return fstype


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def writemap_safe(path: str | os.PathLike) -> bool:
    """Whether a preallocated LMDB map at ``path`` can be written in place safely."""
    return hasattr(os, "posix_fallocate") and filesystem_type(path) in PREALLOCATING_FILESYSTEMS



WRITEMAP_INITIAL = 8 << 20  # with writemap the map starts small (it is allocated on disk) and doubles


def writemap_size(env, path: Path, map_size: int) -> int:
    """The map to reopen ``env`` (at ``path``) with under ``MDB_WRITEMAP``: twice the pages
    in use (at least ``WRITEMAP_INITIAL``, at most ``map_size``), never below the file's
    size, in whole MiB."""
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    return _round_up(max((path / "data.mdb").stat().st_size, min(map_size, max(WRITEMAP_INITIAL, 2 * used))),
                     1 << 20)


def preallocate(path: Path, size: int) -> None:
    """Allocate the first ``size`` bytes of the data file of the store at ``path``
    (extending it).

    Raises:
        DiskFullError: no room (what was allocated may stay, unused).
    """
    fd = os.open(path / "data.mdb", os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DiskFullError(errno.ENOSPC, f"{path}: disk full: no room for an LMDB map of "
                                              f"{size} bytes ({e.strerror})") from e
        raise HierMemError(f"{path}: cannot allocate the LMDB map: {e}") from e
    finally:
        os.close(fd)


def grow_map(path: Path, map_size: int) -> int:
    """Allocate a larger map for a full writemap environment at ``path``: twice
    ``map_size``, or where the disk lacks room for that, an eighth more (at least 64 KiB;
    the caller retries, growing again while its transaction does not fit).  Returns the
    new size.

    Raises:
        DiskFullError: no room even for the smaller step.
    """
    try:
        preallocate(path, map_size * 2)
        return map_size * 2
    except DiskFullError:
        size = _round_up(map_size + max(1 << 16, map_size // 8), 1 << 16)
        preallocate(path, size)
        return size
