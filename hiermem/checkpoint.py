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
import numpy as np
import torch

from .errors import (DiskFullError, HierMemError, InvalidArgumentError, NonFiniteGradientError, StoreFormatError,
                     StoreIOError)
from . import locks
from .locks import READERS_LOCK, STORE_LOCK
from .tiers.disk import DiskTier, _disk_full, decode_keys

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


class Checkpointing:
    """Checkpoint, restore and export; mixed into HierarchicalStore."""

    def checkpoint(self, dest: str | os.PathLike) -> Path:
        """Flush, then snapshot the whole store into the new directory ``dest``.

        The snapshot holds every row's latest value (all tiers), the optimizer state and
        the layout.  It is written to a temporary directory and renamed into place, so
        ``dest`` appears complete or not at all.  Stale temporaries of killed
        checkpoints in ``dest``'s directory are removed first.

        Raises:
            HierMemError: ``dest`` exists.
            DiskFullError: no room for the copy (``dest`` is not created).
            StoreIOError: an I/O error writing it (``dest`` is not created).
        """
        dest = Path(dest).absolute()
        with self._lock:
            self._check_open()
            self._refuse_readonly("checkpoint")
            if dest.exists():
                raise HierMemError(f"{dest}: checkpoint directory exists; pick a new one")
            self.stale_temporaries_removed += len(clean_stale_temporaries(dest.parent))
            self._checkpoint_dirs = [str(dest.parent)] + [d for d in self._checkpoint_dirs
                                                          if d != str(dest.parent)][:7]
            self.flush()

            def copy(tmp: Path) -> None:
                try:
                    self._disk.env.copy(str(tmp), compact=True)
                except lmdb.Error as e:
                    if _disk_full(tmp, e):
                        raise DiskFullError(errno.ENOSPC, f"{dest}: disk full writing the checkpoint") from e
                    from .tiers.ioerrors import typed
                    raise typed(dest, e, "checkpoint copy") from e
            _publish_dir(dest, copy)
            return dest

    def _refuse_readonly(self, what: str) -> None:
        """Hook of read-only handles (:mod:`hiermem.readonly`); a store writes."""

    def _clean_temporaries(self, meta: dict | None) -> None:
        """Remove stale temporaries beside the store and in the directories it has
        checkpointed into (named in its metadata); count them."""
        self._checkpoint_dirs = [d for d in (meta or {}).get("checkpoint_dirs", []) if isinstance(d, str)][:8]
        n = len(clean_stale_temporaries(self.path.parent, self.path.name))
        for d in self._checkpoint_dirs:
            n += len(clean_stale_temporaries(d))
        self.stale_temporaries_removed = n

    @classmethod
    def restore(cls, checkpoint: str | os.PathLike, path: str | os.PathLike, **overrides):
        """Replace the store at ``path`` by a copy of ``checkpoint`` and open it.

        ``path`` must not be open, in this process or another, for training or read-only;
        restore holds the store's lock from the check to the open, and the swap is one
        atomic rename of the data file, so a kill at any moment leaves the old store or
        the checkpoint.  ``overrides`` are as for :meth:`open`.

        Raises:
            StoreFormatError: ``checkpoint`` is not a store checkpoint, or ``path`` holds
                something else.
            HierMemError: ``path`` is open somewhere.
            DiskFullError, StoreIOError: copying failed (the store is untouched).
        """
        ck, path = Path(checkpoint).absolute(), Path(path).absolute()
        from .locks import HANDOFF as _HANDOFF, OPEN as _OPEN, OPEN_LOCK as _OPEN_LOCK

        with _OPEN_LOCK:
            if os.path.realpath(path) in _OPEN:
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
        with _OPEN_LOCK:
            _HANDOFF[key] = lockfd
        try:
            return cls.open(path, **overrides)
        finally:
            with _OPEN_LOCK:
                fd = _HANDOFF.pop(key, None)
            if fd is not None:  # the open failed before taking it
                os.close(fd)

    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of ``table`` that was ever written: ``(ids [n], records [n, width])``.

        Records are ``[weight | optimizer state]``; rows never written are not listed
        (their value is the initialiser's).  Flushes first.  Not a hot path: one LMDB
        cursor pass over the table's key range.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            self.flush()
            w = self.widths[ti]
            keys, vals = [], []
            db = self._disk.table_database(ti)  # None: nothing of the table was ever written
            if db is not None:
                with self._disk.env.begin(db=db, buffers=False) as txn:
                    for k, v in txn.cursor():
                        keys.append(k)
                        vals.append(v)
            ids = decode_keys(b"".join(keys)).astype(np.int64)
            rec = np.frombuffer(b"".join(vals), dtype="<f4").reshape(len(keys), w)
            return torch.from_numpy(ids.copy()), torch.from_numpy(rec.copy())

    def import_records(self, table: str, ids: torch.Tensor, records: torch.Tensor) -> None:
        """Set whole records ``[n, width]`` (weights and optimizer state) of rows.

        Resident rows are overwritten in their slots (and marked dirty); the others are
        written straight to LMDB in one transaction, so importing a table larger than
        the tiers does not churn the cache.  For duplicate ids the last record wins.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids = self._ids(ti, ids)
            w = self.widths[ti]
            if not isinstance(records, torch.Tensor) or tuple(records.shape) != (ids.numel(), w):
                raise InvalidArgumentError(f"records of table {table} must have shape {(ids.numel(), w)}")
            rec = records.detach().to("cpu", torch.float32)  # indexed by the batch's CPU tensors
            if ids.numel() and not bool(torch.isfinite(rec).all()):
                raise NonFiniteGradientError(f"records of table {table} contain NaN or inf; nothing changed")
            if ids.numel() == 0:
                return
            b = self._batch(ti, ids)
            rec = rec.index_select(0, b.lastpos)
            g = self._keys.find(b.t, b.k)
            res = g >= 0
            out = (~res).nonzero().squeeze(1)
            if out.numel():
                self._disk.write([(ti, b.k[out].cpu().numpy(), rec[out].cpu().numpy())], meta=self._meta())
            ri = res.nonzero().squeeze(1)
            if ri.numel():
                from .batches import Batch

                sub = Batch(b.t[ri], b.k[ri], ri[:0], b.counts[ri], b.lastpos[ri], ri.numel())
                self._scatter(self._locate(sub), rec.index_select(0, ri))

    def clear(self) -> None:
        """Forget every row: all tables return to their initial values (LMDB emptied)."""
        with self._lock:
            self._check_open()
            for tier in (self._dev, self._host):
                occ = tier.occupied()
                if bool((tier.pins[occ] > 0).any()):
                    raise HierMemError("cannot clear a store with pinned rows (a prefetch is in flight)")
            for tier in (self._dev, self._host):
                self._keys.remove_slots(tier.g(tier.occupied()))
                tier.clear()
            self._epoch += 1
            self._memo = self._multi_memo = None
            self._disk.clear_rows(meta=self._meta())
