"""Typed errors raised by hiermem.

Every failure the library detects is a subclass of :class:`HierMemError`, so callers can
catch one type.  Bad *arguments* (wrong dtype, shape, unknown table name) raise the
built-in ``TypeError`` / ``ValueError`` subclasses below, which also derive from
``HierMemError``: ``except ValueError`` and ``except hm.HierMemError`` both work.
"""

from __future__ import annotations


class HierMemError(Exception):
    """Base class of every error hiermem raises on purpose."""


class InvalidIdError(HierMemError, ValueError):
    """An id is negative or outside its table's ``num_rows``."""


class InvalidArgumentError(HierMemError, ValueError):
    """An argument has a valid type but an invalid value (shape, size, capacity ...)."""


class InvalidTypeError(HierMemError, TypeError):
    """An argument has the wrong type or dtype (e.g. float ids)."""


class UnknownTableError(HierMemError, KeyError):
    """A table name that the store does not have."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown table"


class NonFiniteGradientError(HierMemError, ValueError):
    """A gradient (or imported value) holds NaN or inf; nothing was changed."""


class CapacityError(HierMemError):
    """A batch needs more rows resident at once than the device and host tiers hold."""


class StoreClosedError(HierMemError):
    """The store was closed; open it again with ``HierarchicalStore.open``."""


class StoreFormatError(HierMemError):
    """The path is not a hiermem store, is corrupt, or was written by another version."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class StoreVersionError(StoreFormatError):
    """The store's on-disk format version is one this hiermem does not read here: an older
    one that only a writable open migrates, or a newer one.  ``version`` is the store's."""

    def __init__(self, path, version, reason: str):
        super().__init__(path, reason)
        self.version = version


class LayoutMismatchError(StoreFormatError):
    """The store on disk was created with a different table layout or optimizer."""


class DiskFullError(HierMemError, OSError):
    """The disk under the LMDB store is full; the last write did not happen."""


class StoreIOError(HierMemError, OSError):
    """Reading or writing the store's files failed in the operating system (EIO, a
    failing disk, a lost network mount, ...): not a corrupt store.  ``errno`` is the OS
    error number; what the failed call would have written was not written.  Reads are
    retried before this is raised (a read changes nothing); a commit is retried once.
    A full disk is :class:`DiskFullError` instead."""

    def __init__(self, errno_: int, message: str, path=None):
        super().__init__(errno_, message)
        self.path = None if path is None else str(path)

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.strerror}"


class ReadOnlyStoreError(HierMemError):
    """A write (update, write, flush, checkpoint, ...) on a store opened ``readonly=True``."""


class PolicyFileError(HierMemError, ValueError):
    """A policy file is unreadable, names an unknown policy, or has unknown keys."""


class TraceFormatError(HierMemError):
    """A path is not a hiermem access trace, or its manifest or a chunk is corrupt."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class MissingDependencyError(HierMemError, ImportError):
    """An optional dependency is not installed (the message names the pip extra)."""
