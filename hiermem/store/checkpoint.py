"""Checkpoints of a store: consistent across every tier, restorable into a fresh process.

``store.checkpoint(dest)`` flushes every dirty row into LMDB, then copies the LMDB
environment (a compacting ``mdb_env_copy``, a consistent snapshot of one read
transaction) into a temporary directory next to ``dest``, fsyncs it and renames it to
``dest``: a checkpoint directory either exists complete or not at all, whatever moment
the process is killed.  A checkpoint directory is itself a store directory;
``HierarchicalStore.restore(dest, path)`` copies it to ``path`` and opens it there, so
the checkpoint stays untouched.

Temporaries are named ``.NAME.tmp-PID`` (a checkpoint or copy being written) and
``.NAME.restore-PID`` (a restore's copy); a process killed while writing one leaves it
behind.  :func:`clean_stale_temporaries` removes those whose process is gone (its PID
is not running, or is running a process that started after the directory was last
written), and only when they hold nothing but LMDB's files; it runs when a store opens
(beside the store and in the directories it has checkpointed into) and at every
checkpoint (in the destination's directory).

``restore`` takes the store's lock (``hiermem.lock``, as an open does) and the readers'
lock (``hiermem.readers``, held shared by every read-only handle) for the whole swap, so
it can race neither a training process nor a reader; the store it opens inherits the
lock, with no moment between in which another process could open the store.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import lmdb

from ..errors import DiskFullError, HierMemError, StoreFormatError, StoreIOError
from . import locks
from .locks import READERS_LOCK, STORE_LOCK
from ..tiers.disk import DiskTier, _disk_full

_FILES = ("data.mdb",)
_TEMP = re.compile(r"\.(?P<name>.+)\.(?:tmp|restore)-(?P<pid>[0-9]+)")
_TEMP_FILES = {"data.mdb", "lock.mdb"}  # what a temporary of ours may hold


def _started_after(pid: int, when: float) -> bool:
    """Whether process ``pid`` started after time ``when`` (so cannot have written then);
    False where that is not known."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK") > when + 2.0
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def owner_gone(pid: int, mtime: float) -> bool:
    """Whether the process that named a temporary ``...-PID`` (last written at ``mtime``) is
    gone: no process ``pid``, or one started after the temporary was written."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return _started_after(pid, mtime)


def clean_stale_temporaries(parent: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove the stale temporaries in directory ``parent`` (of store ``name`` only, if
    given): ``.X.tmp-PID`` / ``.X.restore-PID`` directories whose process is gone and
    which hold only LMDB's files.  Returns the directories removed.  Never raises for a
    temporary it cannot judge or remove: it leaves it."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        m = _TEMP.fullmatch(e.name)
        base = None if m is None else m["name"].lstrip(".")
        if m is None or (name is not None and base != name and not base.startswith(f"{name}.restore-")):
            continue
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
            st = e.stat(follow_symlinks=False)
            inside = os.listdir(e.path)
        except OSError:
            continue
        if not set(inside) <= _TEMP_FILES or not owner_gone(int(m["pid"]), st.st_mtime):
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        if not os.path.exists(e.path):
            removed.append(Path(e.path))
    return removed


def _os_error(path, e: OSError, doing: str) -> HierMemError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(errno.ENOSPC, f"{path}: disk full {doing}")
    return StoreIOError(e.errno or errno.EIO, f"{path}: I/O error {doing}: {e.strerror or e}", path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_dir(dst: Path, fill) -> None:
    """Make the new directory ``dst`` atomically: ``fill(tmp)`` writes the store files
    into a private temporary directory beside it, which is fsynced and renamed into
    place (removed on any failure)."""
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(mode=0o700, parents=True)
        fill(tmp)
        for f in _FILES:
            os.chmod(tmp / f, 0o600)
            with open(tmp / f, "rb+") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, HierMemError):
            raise
        raise _os_error(dst, e, "writing a store copy") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_store_files(src: Path, dst: Path) -> None:
    """Copy a store directory's LMDB data file to a new directory ``dst`` atomically."""
    def copy(tmp: Path) -> None:
        for f in _FILES:
            shutil.copyfile(src / f, tmp / f)
    _publish_dir(dst, copy)


def _lock_for_restore(path: Path) -> tuple[int, int]:
    """Take ``path``'s store lock and readers' lock exclusively (creating ``path``, mode
    0700, and the lock files); returns their descriptors.

    Raises:
        HierMemError: a process has the store open, or read-only handles are open.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fds = []
    try:
        for name, who in ((STORE_LOCK, "a process has the store open"),
                          (READERS_LOCK, "read-only handles of the store are open")):
            fds.append(locks.take(path, name, True, f"{who}; close it before restoring over it"))
        return fds[0], fds[1]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Checkpoints:
    """A store's checkpoints: where it has checkpointed into (at most eight directories,
    the latest first, saved in its metadata, so their stale temporaries are removed when
    it reopens) and :meth:`take` a checkpoint.  Owned by a
    :class:`~hiermem.store.HierarchicalStore`, whose ``checkpoint`` calls it under the
    store's lock.

    Args:
        path: the store's directory.
        meta: its metadata as read at open (None for a new store).
    """

    def __init__(self, path: Path, meta: dict | None):
        self.dirs = [d for d in (meta or {}).get("checkpoint_dirs", []) if isinstance(d, str)][:8]
        n = len(clean_stale_temporaries(path.parent, path.name))
        for d in self.dirs:
            n += len(clean_stale_temporaries(d))
        #: stale temporaries removed (at open and by checkpoints since)
        self.stale_removed = n

    def take(self, dest: Path, flush, env: lmdb.Environment) -> Path:
        """Remove stale temporaries in ``dest``'s directory, ``flush()`` the store, then copy
        its LMDB environment ``env`` (compacting) into ``dest`` (absolute, new) through a
        temporary directory renamed into place.  See ``HierarchicalStore.checkpoint``."""
        if dest.exists():
            raise HierMemError(f"{dest}: checkpoint directory exists; pick a new one")
        self.stale_removed += len(clean_stale_temporaries(dest.parent))
        self.dirs = [str(dest.parent)] + [d for d in self.dirs if d != str(dest.parent)][:7]
        flush()

        def copy(tmp: Path) -> None:
            try:
                env.copy(str(tmp), compact=True)
            except lmdb.Error as e:
                if _disk_full(tmp, e):
                    raise DiskFullError(errno.ENOSPC, f"{dest}: disk full writing the checkpoint") from e
                from ..tiers.ioerrors import typed
                raise typed(dest, e, "checkpoint copy") from e
        _publish_dir(dest, copy)
        return dest


def restore(checkpoint: str | os.PathLike, path: str | os.PathLike, open_store):
    """Replace the store at ``path`` by a copy of ``checkpoint``, then ``open_store()`` it
    (with the store's lock handed over to that open).  See ``HierarchicalStore.restore``."""
    ck, path = Path(checkpoint).absolute(), Path(path).absolute()
    with locks.OPEN_LOCK:
        if os.path.realpath(path) in locks.OPEN:
            raise HierMemError(f"{path}: store is open in this process; close it before restoring over it")
    if not (ck / "data.mdb").is_file():
        raise StoreFormatError(ck, "not a hiermem checkpoint (no data.mdb)")
    if path.exists() and (not path.is_dir() or (not (path / "data.mdb").exists() and any(
            p.name not in (STORE_LOCK, READERS_LOCK, "lock.mdb") for p in path.iterdir()))):
        raise StoreFormatError(path, "not a hiermem store: restore will not replace it")
    lockfd, readers_fd = _lock_for_restore(path)
    try:
        clean_stale_temporaries(path.parent, path.name)
        new = path.parent / f".{path.name}.restore-{os.getpid()}"
        shutil.rmtree(new, ignore_errors=True)
        copy_store_files(ck, new)
        try:  # validate the copy before the live store is touched
            disk = DiskTier(new, create=False)
            try:
                if disk.read_meta() is None:
                    raise StoreFormatError(ck, "an empty LMDB environment, not a hiermem checkpoint")
            finally:
                disk.close()
            (new / "lock.mdb").unlink(missing_ok=True)
        except StoreFormatError as e:
            shutil.rmtree(new, ignore_errors=True)
            raise StoreFormatError(ck, f"not a hiermem checkpoint: {e}") from e
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        # swap the data file inside the locked directory: one atomic rename, so a kill
        # at any moment leaves the old store or the checkpoint, never no store
        os.replace(new / "data.mdb", path / "data.mdb")
        _fsync_dir(path)
        shutil.rmtree(new, ignore_errors=True)
    except BaseException:
        os.close(lockfd)
        os.close(readers_fd)
        raise
    os.close(readers_fd)  # readers may come now; the store's own lock passes to the open
    key = os.path.realpath(path)
    with locks.OPEN_LOCK:
        locks.HANDOFF[key] = lockfd
    try:
        return open_store()
    finally:
        with locks.OPEN_LOCK:
            fd = locks.HANDOFF.pop(key, None)
        if fd is not None:  # the open failed before taking it
            os.close(fd)
