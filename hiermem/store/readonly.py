"""Read-only handles: read a store's embeddings while another process trains it.

``HierarchicalStore.open(path, readonly=True)`` returns a :class:`ReadOnlyStore`.  Any
number of them, each in its own process, may be open while one process trains on the
store (and while none does).  A read-only handle has no device or host tier: every
lookup is one LMDB read transaction (``getmulti`` of the batch's distinct rows, and the
store's metadata), so each batch is a snapshot of one commit, and LMDB's MVCC means
readers never block the writer and never see part of a transaction.

What a reader sees of a row is its value in LMDB: the value of the writer's last
``flush()`` or ``checkpoint()`` (every dirty row, one transaction), or a newer value the
writer wrote down since when it evicted the row (eviction write-backs are whole
transactions too).  Each row's record (weights and optimizer state) is one value the
writer really held, never a mix of two.  Rows never written read as the deterministic
initialiser's value, as in the store.  ``flush_seq`` is the number of the last flush the
snapshot includes (the writer counts its flushes; 0: none since the store was created):
how stale the handle's view is.

Write methods raise :class:`~hiermem.errors.ReadOnlyStoreError`.  A read-only handle
holds the store's readers' lock (``hiermem.readers``) shared, so ``restore()`` over the
store is refused while it is open; it never takes the store's own lock, so the training
process opens, flushes and closes as usual.  One handle per store per process (LMDB's
rule for one environment).

Thread-safety: the methods take the handle's lock; one handle may serve several threads.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import numpy as np
import torch

from . import locks, validate
from .checkpoint import READERS_LOCK
from ..errors import HierMemError, InvalidArgumentError, ReadOnlyStoreError, StoreClosedError, StoreFormatError
from ..dataplane.optim import optimizer_from_dict
from .placed import dedup
from .locks import OPEN as _OPEN, OPEN_LOCK as _OPEN_LOCK, READERS as _READERS
from .rows import initial_records
from ..tiers.disk import META_KEY, DiskTier, id_keys, key_list, parse_meta
from ..tiers.records import concat_records, table_records
from ..types import TableSpec

_WRITES = ("update", "update_with_row_stat", "write", "flush", "checkpoint", "import_records", "clear",
           "update_bags", "prefetch", "record")


class ReadOnlyStore:
    """A read-only handle on the store at ``path`` (see the module docstring).

    Args:
        path: the store directory.
        device: where looked-up rows are returned (default ``"cpu"``).

    Raises:
        StoreVersionError: the store's format version is 1 (a writable open migrates
            it) or one this hiermem does not know.
        StoreFormatError: ``path`` is not a hiermem store.
        HierMemError: the store is open for writing in this process, already has a
            read-only handle in this process, or is being restored.
    """

    def __init__(self, path: str | os.PathLike, device: str = "cpu"):
        self.path = Path(path).absolute()
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._closed = True
        key = os.path.realpath(self.path)
        with _OPEN_LOCK:
            if key in _OPEN:
                raise HierMemError(f"{self.path}: store is open for writing in this process; read it there")
            if key in _READERS:
                raise HierMemError(f"{self.path}: store already has a read-only handle in this process")
            if not (self.path / "data.mdb").is_file():
                raise StoreFormatError(self.path, "not a hiermem store (no data.mdb)")
            self._lockfd = self._take_readers_lock()
            _READERS.add(key)
        try:
            self._disk = DiskTier(self.path, create=False, readonly=True)
            try:
                meta = self._disk.read_meta()
                if meta is None:
                    raise StoreFormatError(self.path, "an empty LMDB environment, not a hiermem store")
                try:
                    self.tables = tuple(TableSpec.from_dict(d) for d in meta["tables"])
                    self.optimizer = optimizer_from_dict(meta["optimizer"])
                    self.seed = int(meta["seed"])
                except (KeyError, TypeError, ValueError) as e:
                    raise StoreFormatError(self.path, f"corrupt store metadata: {e}") from e
            except BaseException:
                self._disk.close()
                raise
        except BaseException:
            self._release()
            raise
        self._index = {s.name: i for i, s in enumerate(self.tables)}
        self.widths = [s.dim + self.optimizer.state_width(s.dim) for s in self.tables]
        self.flush_seq = int(meta.get("flush_seq", 0))  # of the last snapshot read
        self.lookups = 0
        self.rows_read = 0
        self._closed = False

    def _take_readers_lock(self) -> int:
        return locks.take(self.path, READERS_LOCK, False, "store is being restored; open it again when that is done")

    def _release(self) -> None:
        with _OPEN_LOCK:
            _READERS.discard(os.path.realpath(self.path))
        os.close(self._lockfd)

    # -- validation (the store's own rules) ---------------------------------------------
    def table_index(self, table: str) -> int:
        return validate.table_index(self._index, table)

    def _ids(self, ti: int, ids) -> torch.Tensor:
        return validate.check_ids(self.tables[ti], ids)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path}: read-only handle is closed")

    # -- reads --------------------------------------------------------------------------
    def records(self, table: str, ids) -> torch.Tensor:
        """Records ``[len(ids), width]`` (weights then optimizer state, float32) of ``ids``,
        all from one snapshot; sets :attr:`flush_seq` to that snapshot's.

        Raises:
            InvalidIdError, InvalidTypeError, InvalidArgumentError, UnknownTableError,
            StoreClosedError, StoreIOError, StoreFormatError.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids = self._ids(ti, ids).cpu()
            w = self.widths[ti]
            if ids.numel() == 0:
                return torch.empty((0, w), dtype=torch.float32, device=self.device)
            u, inverse = dedup(ids)[:2]
            rec = self._read(ti, u)
            return rec.index_select(0, inverse).to(self.device)

    def lookup(self, table: str, ids) -> torch.Tensor:
        """Rows ``[len(ids), dim]`` (float32, on ``device``) of ``ids``, from one snapshot."""
        dim = self.tables[self.table_index(table)].dim
        return self.records(table, ids)[:, :dim]

    def _read(self, ti: int, u: torch.Tensor) -> torch.Tensor:
        """Records of distinct sorted ids ``u`` and the snapshot's flush number."""
        w, n = self.widths[ti], u.numel()
        ids = id_keys(u.numpy())  # sorted and distinct (dedup)
        disk = self._disk
        db = disk.table_database(ti)  # None: nothing of the table was ever written

        def snapshot(txn):
            return (txn.get(META_KEY, db=disk.meta_db),
                    txn.cursor(db=db).getmulti(key_list(ids)) if db is not None else [])
        raw_meta, res = disk.snapshot_read(snapshot)
        if raw_meta is None:
            raise StoreFormatError(self.path, "store metadata vanished")
        seq = int(parse_meta(self.path, raw_meta).get("flush_seq", 0))
        found = np.zeros(n, dtype=bool)
        out = np.zeros((n, w), dtype=np.float32)
        disk.parse_records(res, ti, w, ids, None, found, out)
        rec = torch.from_numpy(out)
        new = torch.from_numpy(~found).nonzero().squeeze(1)
        if new.numel():
            rec[new] = initial_records(self.tables[ti], ti, self.seed, self.optimizer, u[new])
        self.flush_seq = seq
        self.lookups += 1
        self.rows_read += n
        return rec

    def current_flush_seq(self) -> int:
        """The number of the last flush committed now (reads the metadata)."""
        with self._lock:
            self._check_open()
            meta = self._disk.read_meta() or {}
            return int(meta.get("flush_seq", 0))

    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of ``table`` ever written, from one snapshot: ``(ids [n], records
        [n, width])``, ids ascending (rows never written hold the initialiser's value and
        are not listed).  Sets :attr:`flush_seq`."""
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids, rec = concat_records(list(self.iter_export(ti)), self.widths[ti])
            return torch.from_numpy(ids), torch.from_numpy(rec)

    def iter_export(self, ti: int, count: list | None = None):
        """``(ids int64 [m], records float32 [m, width])`` chunks of table ``ti`` in id
        order, all from one read transaction; ``count``, if given, gets the total first."""
        w = self.widths[ti]
        disk = self._disk
        db = disk.table_database(ti)  # before the transaction (opening one takes its own)
        with disk.env.begin(buffers=False) as txn:  # one snapshot for the whole table
            raw_meta = txn.get(META_KEY, db=disk.meta_db)
            self.flush_seq = int(parse_meta(self.path, raw_meta).get("flush_seq", 0)) if raw_meta else 0
            if count is not None:
                count.append(txn.stat(db)["entries"] if db is not None else 0)
            if db is None:
                return
            yield from table_records(self.path, txn, db, ti, w)

    def stats(self) -> dict:
        """What this handle has read, and the flush number of its last snapshot."""
        with self._lock:
            return {"path": str(self.path), "readonly": True, "flush_seq": self.flush_seq, "lookups": self.lookups,
                    "rows_read": self.rows_read, "tables": [s.name for s in self.tables]}

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Close the handle (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._disk.close()
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    readonly = True

    def __enter__(self) -> "ReadOnlyStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReadOnlyStore({self.path}, tables={[s.name for s in self.tables]}, flush_seq={self.flush_seq})"


def _refuse(name: str):
    def refuse(self, *args, **kwargs):
        raise ReadOnlyStoreError(f"{self.path}: {name}() on a read-only handle; open the store without "
                                 "readonly=True to write")
    refuse.__name__ = name
    refuse.__doc__ = f"Refused: raises :class:`ReadOnlyStoreError` ({name} writes)."
    return refuse


for _name in _WRITES:
    setattr(ReadOnlyStore, _name, _refuse(_name))


def export_npy(path: str | os.PathLike, table: str, out: str | os.PathLike) -> tuple[int, int]:
    """Write ``table``'s rows (ids and weights) of the store at ``path`` to ``out`` (.npy of
    a structured array ``[("id", int64), ("weight", float32, (dim,))]``, mode 0600,
    written to a temporary and renamed).  Works while another process trains.  Returns
    ``(rows, flush_seq)``.

    Raises:
        InvalidArgumentError: ``out`` does not end in ``.npy``.
    """
    out = Path(out)
    if out.suffix != ".npy":
        raise InvalidArgumentError(f"{out}: the output must be a .npy file")
    with ReadOnlyStore(path) as r:
        ti = r.table_index(table)
        dim = r.tables[ti].dim
        dt = np.dtype([("id", "<i8"), ("weight", "<f4", (dim,))])
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        count: list[int] = []
        chunks = r.iter_export(ti, count)
        first = next(chunks, None)  # the count comes first
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        try:
            arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dt, shape=(count[0],))
            at = 0
            for ids, rec in itertools.chain([first] if first is not None else [], chunks):
                arr["id"][at:at + len(ids)], arr["weight"][at:at + len(ids)] = ids, rec[:, :dim]
                at += len(ids)
            arr.flush()
            del arr
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return at, r.flush_seq
