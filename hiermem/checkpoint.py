"""Checkpoints of a store: consistent across every tier, restorable into a fresh process.

``store.checkpoint(dest)`` flushes every dirty row into LMDB, then copies the LMDB
environment (a compacting ``mdb_env_copy``, a consistent snapshot of one read
transaction) into a temporary directory next to ``dest``, fsyncs it and renames it to
``dest``: a checkpoint directory either exists complete or not at all, whatever moment
the process is killed.  A checkpoint directory is itself a store directory;
``HierarchicalStore.restore(dest, path)`` copies it to ``path`` and opens it there, so
the checkpoint stays untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import lmdb
import numpy as np
import torch

from .errors import DiskFullError, HierMemError, InvalidArgumentError, NonFiniteGradientError, StoreFormatError
from .tiers.disk import KEY_DTYPE, DiskTier, _disk_full

_FILES = ("data.mdb",)


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
    tmp.mkdir(mode=0o700, parents=True)
    try:
        fill(tmp)
        for f in _FILES:
            os.chmod(tmp / f, 0o600)
            with open(tmp / f, "rb+") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_store_files(src: Path, dst: Path) -> None:
    """Copy a store directory's LMDB data file to a new directory ``dst`` atomically."""
    def copy(tmp: Path) -> None:
        for f in _FILES:
            shutil.copyfile(src / f, tmp / f)
    _publish_dir(dst, copy)


class Checkpointing:
    """Checkpoint, restore and export; mixed into HierarchicalStore."""

    def checkpoint(self, dest: str | os.PathLike) -> Path:
        """Flush, then snapshot the whole store into the new directory ``dest``.

        The snapshot holds every row's latest value (all tiers), the optimizer state and
        the layout.  It is written to a temporary directory and renamed into place, so
        ``dest`` appears complete or not at all.

        Raises:
            HierMemError: ``dest`` exists.
            DiskFullError: no room for the copy (``dest`` is not created).
        """
        dest = Path(dest).absolute()
        with self._lock:
            self._check_open()
            if dest.exists():
                raise HierMemError(f"{dest}: checkpoint directory exists; pick a new one")
            self.flush()

            def copy(tmp: Path) -> None:
                try:
                    self._disk.env.copy(str(tmp), compact=True)
                except lmdb.Error as e:
                    if _disk_full(tmp, e):
                        raise DiskFullError(errno.ENOSPC, f"{dest}: disk full writing the checkpoint") from e
                    raise HierMemError(f"{dest}: checkpoint copy failed: {e}") from e
            _publish_dir(dest, copy)
            return dest

    @classmethod
    def restore(cls, checkpoint: str | os.PathLike, path: str | os.PathLike, **overrides):
        """Replace the store at ``path`` by a copy of ``checkpoint`` and open it.

        ``path`` must not be open.  ``overrides`` are as for :meth:`open`.

        Raises:
            StoreFormatError: ``checkpoint`` is not a store checkpoint.
        """
        ck, path = Path(checkpoint).absolute(), Path(path).absolute()
        from .store import _OPEN, _OPEN_LOCK

        with _OPEN_LOCK:
            if os.path.realpath(path) in _OPEN:
                raise HierMemError(f"{path}: store is open in this process; close it before restoring over it")
        if not (ck / "data.mdb").is_file():
            raise StoreFormatError(ck, "not a hiermem checkpoint (no data.mdb)")
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
        except StoreFormatError as e:
            shutil.rmtree(new, ignore_errors=True)
            raise StoreFormatError(ck, f"not a hiermem checkpoint: {e}") from e
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        if (path / "data.mdb").is_file():
            # swap the data file inside the live directory: one atomic rename, so a kill
            # at any moment leaves the old store or the checkpoint, never no store
            os.replace(new / "data.mdb", path / "data.mdb")
            _fsync_dir(path)
            shutil.rmtree(new, ignore_errors=True)
        else:
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                shutil.rmtree(new, ignore_errors=True)
                raise StoreFormatError(path, "not a hiermem store: restore will not replace it")
            if path.exists():
                os.rmdir(path)
            os.rename(new, path)
            _fsync_dir(path.parent)
        return cls.open(path, **overrides)

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
            start = np.array([(ti, 0)], dtype=KEY_DTYPE).view("S12")[0]
            keys, vals = [], []
            with self._disk.env.begin(db=self._disk.rows_db, buffers=False) as txn:
                cur = txn.cursor()
                if cur.set_range(bytes(start.ljust(12, b"\0"))):
                    prefix = bytes(start.ljust(12, b"\0"))[:4]
                    for k, v in cur:
                        if k[:4] != prefix:
                            break
                        keys.append(k)
                        vals.append(v)
            ids = np.frombuffer(b"".join(keys), dtype=KEY_DTYPE)["k"].astype(np.int64)
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
            rec = records.detach().to(self.device, torch.float32)
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
                from .store import Batch

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
