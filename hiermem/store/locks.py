"""The lock files of a store directory, opened and locked one way everywhere.

A store directory holds two lock files: ``hiermem.lock``, held exclusively by the one
process that has the store open for writing (and by ``restore``), and
``hiermem.readers``, held shared by read-only handles and exclusively by ``restore``.
Both are ``flock`` locks: the kernel drops them when the process dies, so a killed
trainer never leaves a store locked.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

from ..errors import HierMemError, StoreFormatError

STORE_LOCK = "hiermem.lock"  # exclusive: the writing process, or restore
READERS_LOCK = "hiermem.readers"  # shared by read-only handles, exclusive by restore

# this process's own claims (flock does not conflict within one process): guarded by OPEN_LOCK
OPEN: set[str] = set()  # real paths of store directories open for writing here
READERS: set[str] = set()  # real paths of store directories with a read-only handle here
HANDOFF: dict[str, int] = {}  # store lock descriptors restore() took for the open that follows
OPEN_LOCK = threading.Lock()


#: How long a store's open waits for its lock held by another process (seconds).  A
#: process killed while one of its threads was starting a child (its I/O process: between
#: the fork and the exec) leaves its descriptors, the lock's among them, in that child
#: for a few milliseconds more; an open right after the kill (a restart, the torture
#: check) would otherwise say the store is open elsewhere.
LOCK_WAIT = 0.5


def take(directory: Path, name: str, exclusive: bool, busy: str, wait: float = 0.0) -> int:
    """Open (creating it, mode 0600) and ``flock`` the lock file ``directory / name``,
    trying for up to ``wait`` seconds; returns its descriptor, which holds the lock until
    closed.

    Raises:
        StoreFormatError: the lock file's path is a directory (not a hiermem store).
        HierMemError: the file cannot be opened (with the OS's reason), or another
            process holds a conflicting lock (``busy`` says who, for the message).
    """
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except IsADirectoryError:
        raise StoreFormatError(directory, f"not a hiermem store: {path} is a directory") from None
    except OSError as e:
        raise HierMemError(f"{directory}: cannot open the lock file {name}: {e}") from e
    end = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= end:
                os.close(fd)
                raise HierMemError(f"{directory}: {busy}") from None
            time.sleep(0.005)


def claim_store(path: Path) -> tuple[int, bool]:
    """Claim the store directory ``path`` for writing in this process: created if need
    be (mode 0700), its store lock taken (or handed over by a restore).  Returns the lock's
    descriptor and whether the lock file was made now.

    Raises:
        HierMemError: the store is open here or in another process, or has a read-only
            handle in this process.
        StoreFormatError: ``path`` is a file.
    """
    key = os.path.realpath(path)
    with OPEN_LOCK:
        if key in OPEN:
            raise HierMemError(f"{path}: store is already open in this process")
        if key in READERS:
            raise HierMemError(f"{path}: store has a read-only handle in this process; close it first")
        if path.exists() and not path.is_dir():
            raise StoreFormatError(path, "not a hiermem store (a file, expected a store directory)")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = not (path / STORE_LOCK).exists()
        fd = HANDOFF.pop(key, None)  # locked by restore() for this open
        if fd is None:
            fd = take(path, STORE_LOCK, True, "store is open in another process", wait=LOCK_WAIT)
        try:  # private even if loosened since, as DiskTier makes LMDB's files
            os.fchmod(fd, 0o600)
        except PermissionError:  # another owner's file: leave it
            pass
        OPEN.add(key)
        return fd, made


def release_store(path: Path, fd: int, unlink: bool = False) -> None:
    """Give up the claim of :func:`claim_store`; ``unlink``: remove the lock file made by
    it (a refused foreign directory is left as it was)."""
    with OPEN_LOCK:
        OPEN.discard(os.path.realpath(path))
        if unlink:
            (path / STORE_LOCK).unlink(missing_ok=True)
        os.close(fd)
