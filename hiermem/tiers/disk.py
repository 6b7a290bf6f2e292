"""The disk tier: every row not held above lives in an LMDB environment.

Keys are 12 bytes, big-endian ``(table index u32, id u64)``, so LMDB's byte order is
numeric order.  A value is the row's record (weights then optimizer state) as
little-endian float32.  A sub-database ``meta`` holds the store's layout as JSON.

Reads are one ``getmulti`` per batch, writes one transaction per batch (``putmulti``,
keys in order).  :meth:`DiskTier.read_ahead` reads the records of an upcoming batch on
another thread, outside the store's lock; :meth:`DiskTier.read` then takes them from
that cache.  A cached record is exactly LMDB's current value: every write drops the
cached copies of the keys it writes, and a read-ahead drops the keys written while it
read (a log kept only while one is in flight).

With ``write_behind``, eviction write-backs (:meth:`DiskTier.enqueue`) are committed by
a writer thread, in order, at most ``WRITE_BEHIND_BATCHES`` behind; until committed a
row's record is in that queue, and :meth:`DiskTier.read` takes it from there.  Every
other write, and :meth:`DiskTier.drain` (flush, checkpoint, close), waits for the queue
first.  A failed background commit keeps its batch queued; the next call that writes or
drains retries it on the caller's thread and raises the typed error there.
With ``io_process`` (the store's default on Linux) those background threads (the writer,
and each read-ahead thread) hand their LMDB work to a child process each
(:mod:`hiermem.tiers.lmdb_process`): py-lmdb holds the GIL while it works, so done on
the thread itself it would stop the training thread; the protocol above is unchanged (a
child commits a queued batch, then the thread drops it from the queue).  A child that
dies or fails is replaced, and after three failures the threads do the I/O themselves.
When LMDB's map fills, the map doubles and the transaction is retried; a real disk-full
error aborts the transaction (nothing is written) and raises :class:`DiskFullError`.

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
import json
import os
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import lmdb
import numpy as np

from ..errors import DiskFullError, HierMemError, StoreFormatError
from . import lmdb_process
from .lmdb_process import LmdbProcess, LmdbProcessError
from ..stats import Histogram

KEY_DTYPE = np.dtype([("t", ">u4"), ("k", ">u8")])
META_KEY = b"store"
FORMAT = "hiermem-store"
FORMAT_VERSION = 1


def encode_keys(t: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Keys as an ``S12`` array (sortable; use :func:`key_list` for LMDB, as ``S``
    conversion to ``bytes`` drops trailing zero bytes)."""
    a = np.empty(len(k), dtype=KEY_DTYPE)
    a["t"] = t
    a["k"] = k
    return a.view("S12")


def key_list(keys: np.ndarray) -> list[bytes]:
    """``S12`` keys as a list of 12-byte ``bytes`` (``V12`` keeps trailing zeros)."""
    return keys.view("V12").tolist()


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


_META_MAGIC = 0xBEEFC0DE


def _check_lmdb_file(path: Path, data: Path) -> None:
    """Refuse a ``data.mdb`` that is not LMDB or is shorter than its meta pages say.

    LMDB maps the file and would fault (SIGBUS) reading pages past a truncated end, so
    the two meta pages (page header 16 bytes, then magic u32, version u32, address,
    map size, the free db whose first u32 is the page size, the main db, last page u64,
    txn id u64) are read here first.
    """
    size = data.stat().st_size
    with open(data, "rb") as f:
        head = f.read(4096)
        if len(head) < 152:
            raise StoreFormatError(path, f"corrupt store: {data} is truncated ({size} bytes)")
        magic, _version = struct.unpack_from("<II", head, 16)
        if magic != _META_MAGIC:
            raise StoreFormatError(path, f"not a hiermem store: {data} is not an LMDB file")
        psize = struct.unpack_from("<I", head, 40)[0]
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1) or size < 2 * psize:
            raise StoreFormatError(path, f"corrupt store: {data} is truncated or has a bad page size")
        metas = []
        for page in (0, 1):
            f.seek(page * psize)
            m = f.read(152)
            if struct.unpack_from("<I", m, 16)[0] == _META_MAGIC:
                last_pg, txnid = struct.unpack_from("<QQ", m, 136)
                metas.append((txnid, last_pg))
    if not metas:
        raise StoreFormatError(path, f"corrupt store: {data} has no valid meta page")
    _txnid, last_pg = max(metas)
    if size < (last_pg + 1) * psize:
        raise StoreFormatError(path, f"corrupt store: {data} is truncated ({size} bytes, its pages "
                                     f"need {(last_pg + 1) * psize})")


@dataclass
class _Ahead:
    """Read-ahead records of one table's keys: ``ids`` sorted, ``live`` until used or
    overwritten; ``found`` False where LMDB had no record (the row was never written)."""

    table: int
    ids: np.ndarray
    found: np.ndarray
    rec: np.ndarray
    live: np.ndarray

    def drop(self, ids: np.ndarray) -> None:
        """Mark ``ids`` (uint64, any order) not live: one binary search each."""
        if not len(self.ids) or not len(ids):
            return
        j = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        self.live[j[self.ids[j] == ids]] = False


WRITEMAP_INITIAL = 8 << 20  # with writemap the map starts small (it is allocated on disk) and doubles
AHEAD_BATCHES = 4  # read-ahead batches kept (older ones are dropped unused)
WRITE_BEHIND_BATCHES = 2  # write-back batches queued at most (an enqueue beyond waits)


@dataclass
class _Queued:
    """One queued write-back: per table, ids sorted (in key order) with their records."""

    groups: list[tuple[int, np.ndarray, np.ndarray]]
    meta_raw: bytes | None
    nbytes: int


class DiskTier:
    """An LMDB environment at ``path`` (a directory).

    Args:
        path: directory of the environment; created (mode 0700) when ``create``.
        create: allow creating a new environment.
        map_size: initial map size in bytes; doubled whenever it fills.
        sync: fsync on every commit; when False only :meth:`sync` (called by flush)
            forces data to disk.
        write_behind: commit :meth:`enqueue`'d write-backs on a writer thread.
        io_process: the writer thread and read-ahead threads hand their LMDB work to a
            child process each (:class:`~hiermem.tiers.lmdb_process.LmdbProcess`);
            falls back to doing it in-thread when unsupported or when a child fails.
        writemap: write through a preallocated shared map (see the module docstring);
            None: where :func:`writemap_safe`, and only if the whole map can be
            allocated now (else without, writing only the pages used).  The map then
            starts at twice the pages in use (at least ``WRITEMAP_INITIAL``, at most
            ``map_size``; never below the file's size) and doubles as it fills.

    Raises:
        DiskFullError: ``writemap=True`` and the disk has no room for the map.
    """

    def __init__(self, path: str | os.PathLike, create: bool, map_size: int = 1 << 28, sync: bool = True,
                 write_behind: bool = False, io_process: bool = False, writemap: bool | None = False):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise StoreFormatError(self.path, "not a hiermem store (a file, expected a store directory)")
        data = self.path / "data.mdb"
        fresh = not data.exists()
        if fresh:
            if not create:
                raise StoreFormatError(self.path, "not a hiermem store (no data.mdb)")
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif not data.is_file():
            raise StoreFormatError(self.path, f"not a hiermem store: {data} is not a regular file")
        else:
            _check_lmdb_file(self.path, data)
        try:
            self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4, mode=0o600,
                                 readahead=False, meminit=False, create=create, sync=sync)
        except lmdb.Error as e:
            if _is_enospc(e):
                raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full creating the store") from e
            raise StoreFormatError(self.path, f"not a readable LMDB store: {e}") from e
        try:
            with self.env.begin() as txn:  # a foreign LMDB has keys of its own: refuse it untouched
                names = {k for k, _ in txn.cursor()}
            if names - {b"rows", b"meta"} or (names and names != {b"rows", b"meta"}):
                raise StoreFormatError(self.path, "an LMDB environment, but not a hiermem store")
            self._fresh = not names
            if self._fresh and not create:
                raise StoreFormatError(self.path, "an empty LMDB environment, not a hiermem store")
            self.rows_db = self.env.open_db(b"rows", create=self._fresh)
            self.meta_db = self.env.open_db(b"meta", create=self._fresh)
        except lmdb.Error as e:
            self.env.close()
            raise StoreFormatError(self.path, f"not a readable LMDB store: {e}") from e
        except BaseException:
            self.env.close()
            raise
        for f in (data, self.path / "lock.mdb"):
            if f.exists():
                os.chmod(f, 0o600)
        self.writemap = False
        if writemap or (writemap is None and writemap_safe(self.path)):
            try:
                self._open_writemap(map_size, sync)
            except HierMemError as e:  # the default does without it when there is no room for the map
                if writemap or not isinstance(e, DiskFullError):
                    self.env.close()
                    raise
        self.map_size = self.env.info()["map_size"]
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_seconds = Histogram()  # each batched read (one getmulti)
        self.write_seconds = Histogram()  # each write transaction, and its sync when asked
        # read-ahead cache (see the module docstring); guarded by _ahead_cv
        self._ahead_cv = threading.Condition()
        self._ahead: list[list[_Ahead]] = []  # per read-ahead batch, its tables' chunks
        self._ahead_open: int | None = None  # token of the read-ahead in flight
        self._ahead_seq = 0
        self._ahead_active = 0
        self._wlog: list[tuple[int, np.ndarray]] = []  # (table, ids) written while a read-ahead is open
        self.ahead_rows = 0  # records read ahead and kept
        self.ahead_hits = 0  # reads served from them
        # write-behind queue (see the module docstring); guarded by _wq_cv
        self.write_behind = bool(write_behind)
        self._wq: deque[_Queued] = deque()
        self._wq_cv = threading.Condition()
        self._wq_failed = False  # the writer stopped on an error: callers retry
        self._wq_stop = False
        self._writer: threading.Thread | None = None
        # background I/O processes: one per background thread that does LMDB work
        self.io_process = bool(io_process) and lmdb_process.supported()
        self._sync = sync
        self._io = threading.local()
        self._io_lock = threading.Lock()
        self._io_procs: list[LmdbProcess] = []
        self.io_failures = 0  # child processes that failed to start or died (in-thread I/O meanwhile)

    def _open_writemap(self, map_size: int, sync: bool) -> None:
        """Reopen the (validated) environment with ``MDB_WRITEMAP`` over a map allocated
        in full; on DiskFullError the environment stays open as it was."""
        info, psize = self.env.info(), self.env.stat()["psize"]
        used = (info["last_pgno"] + 1) * psize
        size = _round_up(max((self.path / "data.mdb").stat().st_size,
                             min(map_size, max(WRITEMAP_INITIAL, 2 * used))), 1 << 20)
        self._preallocate(size)
        self.env.close()
        for wm in (True, False):  # should the reopen fail, back to the plain environment
            try:
                self.env = lmdb.open(str(self.path), map_size=size, max_dbs=4, readahead=False, meminit=False,
                                     create=False, sync=sync, writemap=wm)
                self.rows_db = self.env.open_db(b"rows", create=False)
                self.meta_db = self.env.open_db(b"meta", create=False)
            except lmdb.Error as e:
                if not wm:
                    raise StoreFormatError(self.path, f"not a readable LMDB store: {e}") from e
                continue
            self.writemap = wm
            return

    def _preallocate(self, size: int) -> None:
        """Allocate the data file's first ``size`` bytes (extending it).

        Raises:
            DiskFullError: no room (what was allocated may stay, unused).
        """
        fd = os.open(self.path / "data.mdb", os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full: no room for an LMDB map of "
                                                  f"{size} bytes ({e.strerror})") from e
            raise HierMemError(f"{self.path}: cannot allocate the LMDB map: {e}") from e
        finally:
            os.close(fd)

    def _grown_map(self) -> int:
        """Allocate a larger map for :meth:`_write_txn` (writemap): double it, or where the
        disk lacks room for that, grow by an eighth (at least 64 KiB; the caller retries,
        growing again while the transaction does not fit).

        Raises:
            DiskFullError: no room even for the smaller step.
        """
        try:
            self._preallocate(self.map_size * 2)
            return self.map_size * 2
        except DiskFullError:
            size = _round_up(self.map_size + max(1 << 16, self.map_size // 8), 1 << 16)
            self._preallocate(size)
            return size

    # -- metadata ---------------------------------------------------------------
    def read_meta(self) -> dict | None:
        """The store's layout, or None for a fresh environment."""
        try:
            with self.env.begin(db=self.meta_db) as txn:
                raw = txn.get(META_KEY)
        except lmdb.Error as e:
            raise StoreFormatError(self.path, f"cannot read store metadata: {e}") from e
        if raw is None:
            if not self._fresh:
                raise StoreFormatError(self.path, "a hiermem-shaped LMDB environment without store metadata")
            return None
        try:
            meta = json.loads(raw)
        except ValueError as e:
            raise StoreFormatError(self.path, f"corrupt store metadata: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise StoreFormatError(self.path, "not a hiermem store (bad format marker)")
        if meta.get("version") != FORMAT_VERSION:
            raise StoreFormatError(self.path, f"store format version {meta.get('version')} is not {FORMAT_VERSION}")
        return meta

    @staticmethod
    def _meta_bytes(meta: dict) -> bytes:
        return json.dumps({**meta, "format": FORMAT, "version": FORMAT_VERSION}, sort_keys=True).encode()

    # -- rows -------------------------------------------------------------------
    def read(self, table: int, ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Records of ``ids`` of one table: ``(found bool[n], records float32[n, width])``.

        Rows not found are left zero in ``records``; duplicate ids get the same record.
        Queued write-backs win over LMDB (the newest queued record of a row is its value).
        """
        with self._wq_cv:  # before reading LMDB: a batch committed meanwhile is still here
            queued = list(self._wq)
        found, out = self._read(table, ids, width)
        for q in queued:  # oldest first: the newest wins
            for t, qids, qrec in q.groups:
                if t != table or not len(qids):
                    continue
                u = np.asarray(ids).astype(np.uint64)
                j = np.minimum(np.searchsorted(qids, u), len(qids) - 1)
                hit = qids[j] == u
                if hit.any():
                    found[hit] = True
                    out[hit] = qrec[j[hit], :width]
        return found, out

    def _read(self, table: int, ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read` from the read-ahead cache and LMDB (the queue aside)."""
        n = len(ids)
        found = np.zeros(n, dtype=bool)
        out = np.zeros((n, width), dtype=np.float32)
        if n == 0:
            return found, out
        keys = encode_keys(np.full(n, table, dtype=np.uint32), ids)
        order = np.argsort(keys, kind="stable")
        skeys = keys[order]
        if n > 1 and bool((skeys[1:] == skeys[:-1]).any()):  # each distinct key once, then expand
            uniq, inverse = np.unique(keys, return_inverse=True)
            f, r = self._read(table, uniq.view(KEY_DTYPE)["k"], width)
            return f[inverse], r[inverse]
        if self._ahead:
            got = self._from_ahead(table, ids, found, out)
            if got.all():
                return found, out
            if got.any():  # read the rest
                rest = ~got
                f, r = self._read(table, ids[rest], width)
                found[rest], out[rest] = f, r
                return found, out
        t0 = time.perf_counter()
        try:
            with self.env.begin(db=self.rows_db, buffers=False) as txn:
                res = txn.cursor().getmulti(key_list(skeys))
        except lmdb.Error as e:
            raise StoreFormatError(self.path, f"LMDB read failed: {e}") from e
        with self._ahead_cv:  # a read-ahead (another thread) observes it too
            self.read_seconds.observe(time.perf_counter() - t0)
        self._parse(res, table, width, skeys, order, found, out)
        return found, out

    def _parse(self, res, table, width, skeys, order, found, out) -> None:
        """Fill ``found``/``out`` at ``order`` positions from getmulti's ``res`` for ``skeys``."""
        if res:
            fk = np.frombuffer(b"".join([kv[0] for kv in res]), dtype="S12")
            raw = b"".join([kv[1] for kv in res])
            if len(raw) != len(res) * width * 4:
                raise StoreFormatError(self.path, f"corrupt store: table {table} records are not {width} floats")
            pos = order[np.searchsorted(skeys, fk)]
            found[pos] = True
            out[pos] = np.frombuffer(raw, dtype="<f4").reshape(len(res), width)
            self.bytes_read += len(raw)

    # -- read-ahead -----------------------------------------------------------------
    def _from_ahead(self, table: int, ids: np.ndarray, found: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill what the read-ahead cache holds of ``ids`` (distinct); which it held."""
        got = np.zeros(len(ids), dtype=bool)
        ids = ids.astype(np.uint64, copy=False)
        with self._ahead_cv:
            for batch in reversed(self._ahead):
                for c in batch:
                    if c.table != table or not len(c.ids):
                        continue
                    j = np.minimum(np.searchsorted(c.ids, ids), len(c.ids) - 1)
                    hit = ~got & (c.ids[j] == ids) & c.live[j]
                    if hit.any():
                        jh = j[hit]
                        found[hit] = c.found[jh]
                        out[hit] = c.rec[jh]
                        c.live[jh] = False  # the row is resident now: its next read is after a write
                        got |= hit
        self.ahead_hits += int(got.sum())
        return got

    def durations(self) -> tuple[Histogram, Histogram]:
        """Copies of the read and write duration histograms."""
        with self._ahead_cv:
            return self.read_seconds.copy(), self.write_seconds.copy()

    def begin_read_ahead(self) -> int:
        """Open a read-ahead (the caller holds the store's lock, so no write is between
        its residency check and this); returns the token for :meth:`read_ahead`."""
        with self._ahead_cv:
            self._ahead_active += 1
            self._ahead_seq += 1  # a later read-ahead's open closes this one (it keeps nothing)
            self._ahead_open = self._ahead_seq
            self._wlog = []
            return self._ahead_seq

    def read_ahead(self, groups: list[tuple[int, np.ndarray, int]], token: int, keep: int | None = None) -> int:
        """Read ``(table, distinct ids, width)`` groups into the cache, without the store's
        lock; returns the records kept.  Best effort: an LMDB error keeps nothing (the
        real read reports it)."""
        try:
            chunks = []
            try:
                chunks = self._read_chunks(groups)
            except (lmdb.Error, StoreFormatError):
                chunks = []
            with self._ahead_cv:
                if self._ahead_open != token:  # cleared, or another read-ahead opened since
                    return 0
                for table, written in self._wlog:  # written while this one read: stale
                    for c in chunks:
                        if c.table == table:
                            c.drop(written)
                self._ahead_open = None
                self._wlog = []
                if chunks:
                    self._ahead.append(chunks)
                    del self._ahead[:-(keep or AHEAD_BATCHES)]
                kept = sum(int(c.live.sum()) for c in chunks)
                self.ahead_rows += kept
                return kept
        finally:
            with self._ahead_cv:
                self._ahead_active -= 1
                self._ahead_cv.notify_all()

    def _read_chunks(self, groups: list[tuple[int, np.ndarray, int]]) -> list[_Ahead]:
        """Records of ``(table, ids, width)`` groups, read by this thread's I/O process
        (or here)."""
        groups = [(table, np.sort(np.asarray(ids).astype(np.uint64)), width) for table, ids, width in groups]
        keys = [encode_keys(np.full(len(ids), table, dtype=np.uint32), ids) for table, ids, _ in groups]
        proc = self._proc(write=False)
        if proc is not None:
            t0 = time.perf_counter()
            try:
                got = proc.read([(k, w) for k, (_, _, w) in zip(keys, groups)])
            except LmdbProcessError as e:
                self._proc_failed(proc, e)
            else:
                with self._ahead_cv:
                    self.read_seconds.observe(time.perf_counter() - t0)
                for (table, ids, _), (found, rec) in zip(groups, got):
                    self.bytes_read += int(found.sum()) * rec.shape[1] * 4
                return [_Ahead(table, ids, found, rec, np.ones(len(ids), dtype=bool))
                        for (table, ids, _), (found, rec) in zip(groups, got)]
        chunks = []
        with self.env.begin(db=self.rows_db, buffers=False) as txn:
            cur = txn.cursor()
            for (table, ids, width), k in zip(groups, keys):
                found = np.zeros(len(ids), dtype=bool)
                rec = np.zeros((len(ids), width), dtype=np.float32)
                t0 = time.perf_counter()
                res = cur.getmulti(key_list(k))
                with self._ahead_cv:
                    self.read_seconds.observe(time.perf_counter() - t0)
                self._parse(res, table, width, k, np.arange(len(ids)), found, rec)
                chunks.append(_Ahead(table, ids, found, rec, np.ones(len(ids), dtype=bool)))
        return chunks

    # -- background I/O processes ----------------------------------------------------
    def _proc(self, write: bool) -> LmdbProcess | None:
        """This thread's I/O process (started on first use), or None: do the I/O here."""
        if not self.io_process:
            return None
        p = getattr(self._io, "proc", None)
        if p is not None and p.alive:
            return p
        if p is not None:
            self._proc_failed(p, None)
        with self._io_lock:
            for q in [q for q in self._io_procs if not q.alive]:  # their threads ended
                self._io_procs.remove(q)
                q.close()
            if not self.io_process:
                return None
        try:
            p = LmdbProcess(self.path, self.map_size, write=write, sync=self._sync,
                            writemap=write and self.writemap)
        except (LmdbProcessError, OSError):
            self._proc_failed(None, None)
            return None
        with self._io_lock:
            self._io_procs.append(p)
        self._io.proc = p
        return p

    @property
    def io_processes(self) -> int:
        """I/O processes running now (one per background thread that used one)."""
        with self._io_lock:
            return sum(p.alive for p in self._io_procs)

    def _proc_failed(self, p: LmdbProcess | None, e: LmdbProcessError | None) -> None:
        """Drop a failed or finished process; after three failures, in-thread I/O only."""
        if p is not None:
            self._io.proc = None
            with self._io_lock:
                if p in self._io_procs:
                    self._io_procs.remove(p)
            p.close()
        if e is None or not e.map_full:  # a full map: a new process opens the grown map
            with self._io_lock:
                self.io_failures += 1
                if self.io_failures >= 3:
                    self.io_process = False

    def _written(self, groups: list[tuple[int, np.ndarray]]) -> None:
        """Keys just committed: their cached copies are stale."""
        with self._ahead_cv:
            for table, ids in groups:
                ids = np.asarray(ids).astype(np.uint64)
                for batch in self._ahead:
                    for c in batch:
                        if c.table == table:
                            c.drop(ids)
                if self._ahead_open is not None:
                    self._wlog.append((table, ids))

    def _drop_ahead(self) -> None:
        with self._ahead_cv:
            self._ahead = []
            self._ahead_open = None
            self._wlog = []

    def write(self, groups: Iterable[tuple[int, np.ndarray, np.ndarray]], meta: dict | None = None,
              sync: bool = False) -> int:
        """Write ``(table, ids, records)`` groups (and ``meta``) in one transaction.

        Returns the number of bytes of records written.

        Raises:
            DiskFullError: the disk is full; the transaction was aborted.
        """
        self.drain()  # queued write-backs first: a later write of a row must win
        q = self._prepare(groups, meta)

        t0 = time.perf_counter()
        self._write_txn(self._txn_body(q), q.nbytes)
        if q.groups:
            self._written([(t, ids) for t, ids, _ in q.groups])
        if sync:
            self.sync()
        with self._ahead_cv:
            self.write_seconds.observe(time.perf_counter() - t0)
        self.bytes_written += q.nbytes
        return q.nbytes

    def _prepare(self, groups, meta: dict | None) -> _Queued:
        out, nbytes = [], 0
        for table, ids, rec in groups:
            if len(ids) == 0:
                continue
            rec = np.ascontiguousarray(rec, dtype="<f4")
            keys = encode_keys(np.full(len(ids), table, dtype=np.uint32), ids)
            order = np.argsort(keys, kind="stable")  # in key order the B-tree's pages stay hot
            out.append((table, np.asarray(ids).astype(np.uint64)[order], rec[order]))
            nbytes += rec.nbytes
        return _Queued(out, None if meta is None else self._meta_bytes(meta), nbytes)

    def _txn_body(self, q: _Queued) -> Callable[[lmdb.Transaction], None]:
        def body(txn: lmdb.Transaction) -> None:
            cur = txn.cursor(db=self.rows_db)
            for table, ids, rec in q.groups:
                keys = encode_keys(np.full(len(ids), table, dtype=np.uint32), ids)
                cur.putmulti(zip(key_list(keys), rec.view(f"V{rec.shape[1] * 4}").reshape(len(ids)).tolist()))
            if q.meta_raw is not None:
                txn.put(META_KEY, q.meta_raw, db=self.meta_db)
        return body

    # -- write-behind ----------------------------------------------------------------
    def enqueue(self, groups: Iterable[tuple[int, np.ndarray, np.ndarray]], meta: dict | None = None) -> int:
        """Queue a write-back for the writer thread (``write_behind``; else :meth:`write`).

        Waits while ``WRITE_BEHIND_BATCHES`` are queued.  Returns the bytes of records.

        Raises:
            DiskFullError, HierMemError: an earlier queued write failed and failed again
                when retried here; nothing of this call was queued.
        """
        if not self.write_behind:
            return self.write(groups, meta=meta)
        q = self._prepare(groups, meta)
        while True:
            self._recover()
            with self._wq_cv:
                self._wq_cv.wait_for(lambda: len(self._wq) < WRITE_BEHIND_BATCHES or self._wq_failed)
                if self._wq_failed:
                    continue
                self._wq.append(q)
                self._wq_cv.notify_all()
                break
        self._written([(t, ids) for t, ids, _ in q.groups])  # LMDB's copies are going stale
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="hiermem-lmdb-writer", daemon=True)
            self._writer.start()
        self.bytes_written += q.nbytes
        return q.nbytes

    def _write_loop(self) -> None:
        while True:
            with self._wq_cv:
                self._wq_cv.wait_for(lambda: self._wq_stop or (self._wq and not self._wq_failed))
                if self._wq_stop:
                    return
                q = self._wq[0]
            t0 = time.perf_counter()
            try:  # no map growth here: that needs every reader out (the caller's retry does it)
                proc = self._proc(write=True)
                if proc is not None:
                    try:
                        self._proc_write(proc, q)
                    except LmdbProcessError as e:
                        self._proc_failed(proc, e)
                        raise
                else:
                    with self.env.begin(write=True) as txn:
                        self._txn_body(q)(txn)
            except BaseException:
                with self._wq_cv:
                    self._wq_failed = True
                    self._wq_cv.notify_all()
                continue
            self._committed(q, t0)

    @staticmethod
    def _proc_write(proc: LmdbProcess, q: _Queued) -> None:
        """Commit a queued write-back in the writer thread's I/O process."""
        proc.write([(encode_keys(np.full(len(ids), t, dtype=np.uint32), ids), rec) for t, ids, rec in q.groups],
                   q.meta_raw)

    def _committed(self, q: _Queued, t0: float) -> None:
        self._written([(t, ids) for t, ids, _ in q.groups])  # a read-ahead open meanwhile drops them
        with self._ahead_cv:
            self.write_seconds.observe(time.perf_counter() - t0)
        with self._wq_cv:
            self._wq.popleft()
            self._wq_cv.notify_all()

    def _recover(self) -> None:
        """After a failed background commit: commit the queue here, in order (growing
        the map if it was full), or raise the typed error with the queue kept."""
        with self._wq_cv:
            if not self._wq_failed:
                return
        while True:
            with self._wq_cv:
                if not self._wq:
                    self._wq_failed = False
                    self._wq_cv.notify_all()
                    return
                q = self._wq[0]
            t0 = time.perf_counter()
            self._write_txn(self._txn_body(q), q.nbytes)
            self._committed(q, t0)

    def drain(self) -> None:
        """Wait until every queued write-back is committed (retrying a failed one here).

        Raises:
            DiskFullError, HierMemError: a queued write failed again; it stays queued.
        """
        while True:
            with self._wq_cv:
                self._wq_cv.wait_for(lambda: not self._wq or self._wq_failed)
                if not self._wq:
                    return
            self._recover()

    @property
    def queued(self) -> int:
        """Rows in queued write-backs."""
        with self._wq_cv:
            return sum(len(ids) for q in self._wq for _, ids, _ in q.groups)

    def _write_txn(self, body: Callable[[lmdb.Transaction], None], nbytes: int = 0) -> None:
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    body(txn)
                return
            except lmdb.MapFullError:
                with self._ahead_cv:  # no transaction may be open while the map is resized
                    self._ahead_cv.wait_for(lambda: self._ahead_active == 0, timeout=60)
                    size = self._grown_map() if self.writemap else self.map_size * 2
                    self.env.set_mapsize(size)
                    self.map_size = size
            except lmdb.Error as e:
                if _disk_full(self.path, e, nbytes):
                    raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full; the write was not made ({e})") from e
                raise HierMemError(f"{self.path}: LMDB write failed: {e}") from e

    def clear_rows(self, meta: dict | None = None) -> None:
        """Delete every row (one transaction), keeping the environment and its metadata."""
        self.drain()
        meta_raw = None if meta is None else self._meta_bytes(meta)

        def body(txn: lmdb.Transaction) -> None:
            txn.drop(self.rows_db, delete=False)
            if meta_raw is not None:
                txn.put(META_KEY, meta_raw, db=self.meta_db)

        self._write_txn(body)
        self._drop_ahead()
        self.sync()

    def sync(self) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as e:
            if _disk_full(self.path, e):
                raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full during sync ({e})") from e
            raise HierMemError(f"{self.path}: LMDB sync failed: {e}") from e

    def count(self) -> int:
        with self.env.begin(db=self.rows_db) as txn:
            return txn.stat(self.rows_db)["entries"]

    def close(self) -> None:
        """Close the environment.  Queued write-backs not yet committed are dropped: the
        store drains the queue (flush) before closing."""
        with self._wq_cv:
            self._wq_stop = True
            self._wq_cv.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=60)
        with self._ahead_cv:  # a read-ahead still reading (another thread) finishes first
            self._ahead_cv.wait_for(lambda: self._ahead_active == 0, timeout=60)
            self._ahead = []
            self._ahead_open = None
        with self._io_lock:
            procs, self._io_procs = self._io_procs, []
            self.io_process = False
        for p in procs:
            p.close()
        self.env.close()
