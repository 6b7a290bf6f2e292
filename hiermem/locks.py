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
from pathlib import Path

from .errors import HierMemError, StoreFormatError

STORE_LOCK = "hiermem.lock"  # exclusive: the writing process, or restore
READERS_LOCK = "hiermem.readers"  # shared by read-only handles, exclusive by restore

# this process's own claims (flock does not conflict within one process): guarded by OPEN_LOCK
OPEN: set[str] = set()  # real paths of store directories open for writing here
READERS: set[str] = set()  # real paths of store directories with a read-only handle here
HANDOFF: dict[str, int] = {}  # store lock descriptors restore() took for the open that follows
OPEN_LOCK = threading.Lock()


def take(directory: Path, name: str, exclusive: bool, busy: str) -> int:
    """Open (creating it, mode 0600) and ``flock`` the lock file ``directory / name``
    without waiting; returns its descriptor, which holds the lock until closed.

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
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise HierMemError(f"{directory}: {busy}") from None
    return fd
