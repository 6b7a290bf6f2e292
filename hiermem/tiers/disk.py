"""The disk tier: every row not held above lives in an LMDB environment.

The disk tier's jobs, one module each: the record format and keys (:mod:`.records`),
map growth and ``writemap`` preallocation (:mod:`.mapgrow`), read-ahead
(:mod:`.read_ahead`), write-behind (:mod:`.write_behind`), the background I/O processes
(:mod:`.io_procs`, :mod:`.lmdb_process`) and the typing of LMDB's errors
(:mod:`.ioerrors`); :class:`DiskTier` here opens the environment and does the
synchronous reads and writes.

A record is stored at its table's own width (weights + optimizer state), never padded to
the widest table, in its table's own integer-keyed sub-database (format version 2, see
:mod:`.records`; a version-1 store is migrated when opened with ``migrate=True``).  Reads
are one ``getmulti`` per table of a batch, writes one transaction per batch
(``putmulti`` per table, keys in order; keys past the table's last one appended).  When LMDB's map fills, the map doubles and the
transaction is retried; a real disk-full error aborts the transaction (nothing is
written) and raises :class:`DiskFullError`; an I/O error of the OS raises
:class:`StoreIOError` with its errno (reads are retried first, a commit once), and only
what LMDB finds wrong in the file raises :class:`StoreFormatError`.

``readonly=True`` opens the environment for reading only (no writer, no write-behind, no
I/O processes): any number of such handles, in other processes, read while one process
writes; each read is one LMDB read transaction, a snapshot of the last commit.
"""

from __future__ import annotations

import errno
import operator
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import lmdb
import numpy as np

from ..errors import DiskFullError, HierMemError, StoreFormatError, StoreIOError
from ..observe.stats import Histogram
from .io_procs import IOProcesses
from .ioerrors import _disk_full, _is_enospc, retry_read, typed
from .lmdb_process import LmdbProcess, LmdbProcessError
from .mapgrow import (PREALLOCATING_FILESYSTEMS, WRITEMAP_INITIAL, _round_up, filesystem_type, grow_map, preallocate,
                      writemap_safe, writemap_size)
from .read_ahead import AHEAD_BATCHES, ReadAhead, _Ahead  # noqa: F401
from .records import (FORMAT, FORMAT_VERSION, KEY_DTYPE, KEY_DTYPE_V1, META_DB, META_KEY, ROWS_DB_V1,
                      _check_lmdb_file, concat_records, decode_keys, id_keys, key_list, meta_bytes, parse_meta,
                      parse_values, refuse_v1, table_db, table_of_db, table_records, value_list)
from .slots import table_groups
from .write_behind import WRITE_BEHIND_BATCHES, WriteQueue, _Queued, queued_by_table, take_queued  # noqa: F401
from .combine import WriteCombiner

COMMIT_ATTEMPTS = 2  # a commit that failed with an I/O error is tried once more (LMDB aborted it whole)
MIGRATE_CHUNK = 1 << 16  # version-1 rows copied per transaction of a migration
_KEY, _VALUE = operator.itemgetter(0), operator.itemgetter(1)


def put_sorted(cur: lmdb.Cursor, ids: np.ndarray, rec: np.ndarray) -> None:
    """Put records ``rec`` of distinct ascending ``uint64`` ``ids`` with ``cur`` (a write
    cursor on their table's database): the ids past the table's last key appended
    (``MDB_APPEND``: no search, pages filled), the others put in order."""
    split = 0
    if cur.last():
        split = int(np.searchsorted(ids, decode_keys(cur.key())[0], side="right"))
    if split:
        cur.putmulti(zip(key_list(ids[:split]), value_list(rec[:split])))
    if split < len(ids):
        added = cur.putmulti(zip(key_list(ids[split:]), value_list(rec[split:])), append=True)[1]
        if added != len(ids) - split:
            raise HierMemError("LMDB refused appended keys: ids not distinct and ascending")


def sorted_keys(ids) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(keys, sorted distinct keys, order, inverse)`` of row ids: ``keys`` the ids as
    ``uint64`` (:func:`id_keys`); ``order`` (distinct but unsorted ids) the argsort that
    sorts them, else None; ``inverse`` (repeated ids) maps each id to its distinct key,
    else None.  Sorted distinct ids (the usual case) cost one comparison pass."""
    u = id_keys(ids)
    if len(u) < 2 or bool((u[1:] > u[:-1]).all()):
        return u, u, None, None
    order = np.argsort(u, kind="stable")
    su = u[order]
    if bool((su[1:] == su[:-1]).any()):
        uniq, inverse = np.unique(u, return_inverse=True)
        return u, uniq, None, inverse
    return u, su, order, None


def _scatter(got: tuple[np.ndarray, np.ndarray], order: np.ndarray | None, found: np.ndarray,
             out: np.ndarray) -> None:
    """An I/O process's ``(found, records)`` of sorted ids into ``found``/``out`` at
    ``order``'s positions (None: the sorted order is theirs), as :meth:`DiskTier.parse_records`
    places getmulti's."""
    pos = slice(None) if order is None else order
    found[pos], out[pos] = got


def _background() -> bool:
    """The calling thread is not the main thread: a placement's LMDB read there goes through
    the thread's I/O process, as read-ahead does, because py-lmdb would hold the GIL and stop
    the training thread for the read's length.  The main thread (the training thread, which
    waits for the read anyway) reads in-thread."""
    return threading.current_thread() is not threading.main_thread()


class DiskTier:
    """An LMDB environment at ``path`` (a directory), with its read-ahead cache
    (:attr:`ahead`), write-behind queue (:attr:`queue`) and I/O processes (:attr:`procs`).

    Args:
        path: directory of the environment; created (mode 0700) when ``create``.
        create: allow creating a new environment.
        map_size: initial map size in bytes; doubled whenever it fills.
        sync: fsync on every commit; when False only :meth:`sync` (called by flush)
            forces data to disk.
        write_behind: commit :meth:`enqueue`'d write-backs on a writer thread.
        combine: hold :meth:`enqueue_rows`' write-backs (without ``write_behind``, or with
            ``combine_behind``) until this many records are held, then commit them in one
            transaction (:mod:`.combine`; with ``write_behind`` the writer thread commits
            them, as one queued batch); 0: commit each write-back.
        io_process: the writer thread and read-ahead threads hand their LMDB work to a
            child process each (:class:`~hiermem.tiers.lmdb_process.LmdbProcess`);
            falls back to doing it in-thread when unsupported or when a child fails.
        readonly: open for reading only (see the module docstring); ``create`` must be
            False.  LMDB registers the reader in ``lock.mdb``, so the process needs
            write access to that file.
        writemap: write through a preallocated shared map (see :mod:`.mapgrow`);
            None: where :func:`writemap_safe`, and only if the whole map can be
            allocated now (else without, writing only the pages used).  The map then
            starts at twice the pages in use (at least ``WRITEMAP_INITIAL``, at most
            ``map_size``; never below the file's size) and doubles as it fills.
        tables: tables the store has (their sub-databases are made when the store is
            created; a table written later gets one then).
        migrate: a version-1 store is migrated to this version here (the store's own
            open, under its lock); else such a store opens for :meth:`read_meta` only,
            and a read-only open refuses it.

    Raises:
        DiskFullError: ``writemap=True`` and the disk has no room for the map.
        StoreVersionError: ``readonly`` and a version-1 store, or a version not known.
    """

    def __init__(self, path: str | os.PathLike, create: bool, map_size: int = 1 << 28, sync: bool = True,
                 write_behind: bool = False, io_process: bool = False, writemap: bool | None = False,
                 readonly: bool = False, tables: int = 0, migrate: bool = False, combine: int = 0,
                 combine_behind: bool = False):
        self.path = Path(path)
        self._max_dbs = max(32, int(tables) + 4)
        self.readonly = bool(readonly)
        if self.readonly:
            create, write_behind, io_process, writemap = False, False, False, False
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
        self.env = self._open_env(map_size, create, sync)
        try:
            with self.env.begin() as txn:  # a foreign LMDB has keys of its own: refuse it untouched
                names = {k for k, _ in txn.cursor()}
            tables_on_disk = {n for n in names if table_of_db(n) is not None}
            if names - tables_on_disk - {META_DB, ROWS_DB_V1} or (names and META_DB not in names):
                raise StoreFormatError(self.path, "an LMDB environment, but not a hiermem store")
            self._fresh = not names
            if self._fresh and not create:
                raise StoreFormatError(self.path, "an empty LMDB environment, not a hiermem store")
            if len(names) + 4 > self._max_dbs:  # more tables than asked for: room for each
                self._max_dbs = len(names) + 4
                self.env.close()
                self.env = self._open_env(map_size, create, sync)
            self.version = 1 if ROWS_DB_V1 in names else FORMAT_VERSION
            self._open_dbs(create=self._fresh)
            if not self.readonly and not self._fresh and self._adopt_newest_commit():
                self._open_dbs()  # the newest commit's tables
            if self._fresh:
                self.ensure_tables(tables)
        except lmdb.Error as e:
            self.env.close()
            raise StoreFormatError(self.path, f"not a readable LMDB store: {e}") from e
        except BaseException:
            self.env.close()
            raise
        if self.version == 1 and self.readonly:
            self.env.close()
            raise refuse_v1(self.path, "a read-only open")
        for f in (data, self.path / "lock.mdb"):
            if f.exists() and not self.readonly:
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
        self._timing = threading.Lock()  # the histograms (read-ahead and writer threads observe too)
        self.write_behind = bool(write_behind)
        self.ahead = ReadAhead(self._read_groups)
        self.queue = WriteQueue(self._commit_queued, lambda q: self._write_txn(self._txn_body(q), q.nbytes),
                                self._committed)
        self.procs = IOProcesses(self.path, io_process, sync, self._max_dbs)
        #: eviction write-backs held for one later commit (None: each is committed)
        self.combine = (WriteCombiner(combine) if combine > 0 and not readonly
                        and (combine_behind or not self.write_behind) else None)
        if self.version == 1 and migrate:
            try:
                self._migrate_v1()
            except BaseException:
                self.close()
                raise

    def _adopt_newest_commit(self) -> bool:
        """Make this environment's transactions start from the newest commit in the data
        file; whether they did not.

        LMDB's transactions (read and write) take their snapshot from the lock file's
        record of the last commit, which a writer sets just after writing the commit's
        meta page. A writer killed between the two (a trainer's I/O process, dying with
        it) leaves the record one commit behind; LMDB rebuilds it from the data file when
        it opens the lock file alone, or when the next writer takes the writers' mutex
        and finds its owner dead. A store reopened while another process still had the
        environment (an I/O process still exiting, a read-only handle) read the state
        before its newest durable commit until its first write (found by
        ``scripts/torture.py``: a reopened store's step counts ran ahead of what the
        check right after the kill had read). So a writable open takes the writers'
        mutex once, which recovers a dead owner's commit.

        Raises:
            StoreIOError: the record is still behind (another process has the store open
                and no writer died in a commit): a write would replace the newest commit;
                nothing was changed.
        """
        def behind() -> tuple[int, int]:
            with self.env.begin() as txn:
                return txn.id(), self.env.info()["last_txnid"]
        seen, last = behind()
        if seen == last:
            return False
        self.env.begin(write=True).abort()  # the writers' mutex: LMDB recovers a dead owner's commit
        seen, last = behind()
        if seen != last:
            raise StoreIOError(errno.EBUSY, f"{self.path}: LMDB's lock file records commit {seen} but the data "
                                            f"file holds {last}, and another process has the store open: close "
                                            "it, then open the store again (nothing was changed)")
        return True

    def _open_env(self, map_size: int, create: bool, sync: bool) -> lmdb.Environment:
        try:
            return lmdb.open(str(self.path), map_size=map_size, max_dbs=self._max_dbs, mode=0o600,
                             readahead=False, meminit=False, create=create, sync=sync, readonly=self.readonly)
        except lmdb.Error as e:
            if _is_enospc(e):
                raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full creating the store") from e
            if isinstance(typed(self.path, e, "open"), StoreIOError) and not isinstance(e, lmdb.ReadonlyError):
                raise typed(self.path, e, "open") from e
            raise StoreFormatError(self.path, f"not a readable LMDB store: {e}") from e

    def _open_dbs(self, create: bool = False) -> None:
        """Open the metadata database, every table's (and version 1's rows) of ``env``."""
        self.meta_db = self.env.open_db(META_DB, create=create)
        self.rows_db = self.env.open_db(ROWS_DB_V1, create=False) if self.version == 1 else None
        self._dbs: dict[int, object] = {}
        with self.env.begin() as txn:
            names = [k for k, _ in txn.cursor()]
        for name in names:
            t = table_of_db(name)
            if t is not None:
                self._dbs[t] = self.env.open_db(name, create=False, integerkey=True)

    def _open_writemap(self, map_size: int, sync: bool) -> None:
        """Reopen the (validated) environment with ``MDB_WRITEMAP`` over a map allocated
        in full (:mod:`.mapgrow`); on DiskFullError the environment stays open as it was."""
        size = writemap_size(self.env, self.path, map_size)
        preallocate(self.path, size)
        self.env.close()
        for wm in (True, False):  # should the reopen fail, back to the plain environment
            try:
                self.env = lmdb.open(str(self.path), map_size=size, max_dbs=self._max_dbs, readahead=False,
                                     meminit=False, create=False, sync=sync, writemap=wm)
                self._open_dbs()
            except lmdb.Error as e:
                if not wm:
                    raise StoreFormatError(self.path, f"not a readable LMDB store: {e}") from e
                continue
            self.writemap = wm
            return

    def ensure_tables(self, n: int) -> None:
        """Make the sub-databases of tables ``0..n-1`` that do not exist yet (no transaction
        of this thread may be open)."""
        for t in range(n):
            self.table_database(t, create=True)

    def committed_records(self, table: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Every record of table ``table`` committed to LMDB, in id order, from one read
        transaction: ``(ids int64 [n], records float32 [n, width])`` (rows held for a
        combined commit are not there yet: flush first).  Raises StoreFormatError on a
        record of another width."""
        db = self.table_database(table)  # None: nothing of the table was ever written
        if db is None:
            return concat_records([], width)
        return self.snapshot_read(lambda txn: concat_records(list(table_records(self.path, txn, db, table, width)),
                                                             width), "export")

    def table_database(self, table: int, create: bool = False):
        """Table ``table``'s sub-database (made when ``create``), or None where it has none
        (nothing of it was ever written).  Opening one takes a transaction of its own: call
        it outside of any."""
        db = self._dbs.get(table)
        if db is not None:
            return db
        if not (self.readonly and create):
            if table + 4 > self._max_dbs:
                raise HierMemError(f"{self.path}: table {table} is beyond the {self._max_dbs - 4} tables this "
                                   "handle was opened for")
            try:
                db = self.env.open_db(table_db(table), create=create and not self.readonly, integerkey=True)
            except lmdb.NotFoundError:
                return None
            self._dbs[table] = db
        return db

    def _check_version(self) -> None:
        if self.version != FORMAT_VERSION:
            raise refuse_v1(self.path, "a handle opened for its metadata only")

    def _migrate_v1(self) -> None:
        """Rewrite a version-1 store as version 2, in place: every row of ``rows`` copied
        to its table's database (``MIGRATE_CHUNK`` rows a transaction, appended in key
        order), then ``rows`` dropped and the version-2 metadata written in one last
        transaction, and synced.  A migration killed before that last commit leaves a
        version-1 store (the partial copies are dropped when it starts again)."""
        raw = self.snapshot_read(lambda txn: txn.get(META_KEY, db=self.meta_db), "metadata read")
        if raw is None:
            raise StoreFormatError(self.path, "a hiermem-shaped LMDB environment without store metadata")
        meta = parse_meta(self.path, raw, version=1)
        tables = meta.get("tables")
        if not isinstance(tables, list) or not tables:
            raise StoreFormatError(self.path, "corrupt store metadata: no tables")
        if len(tables) + 4 > self._max_dbs:
            raise HierMemError(f"{self.path}: open the store with tables={len(tables)} to migrate it")
        self.ensure_tables(len(tables))

        def clear(txn: lmdb.Transaction) -> None:
            for db in self._dbs.values():
                txn.drop(db, delete=False)
        self._write_txn(clear)
        start: list[bytes | None] = [b""]
        while start[0] is not None:
            self._write_txn(self._migrate_chunk(start, len(tables)))

        def finish(txn: lmdb.Transaction) -> None:
            txn.drop(self.rows_db, delete=True)
            txn.put(META_KEY, meta_bytes(meta), db=self.meta_db)
        self._write_txn(finish)
        self.rows_db, self.version = None, FORMAT_VERSION
        self.sync()

    def _migrate_chunk(self, start: list, ntables: int) -> Callable[[lmdb.Transaction], None]:
        """The body of one migration transaction: up to ``MIGRATE_CHUNK`` version-1 rows
        from key ``start[0]`` on; sets ``start[0]`` to the next key (None: done)."""
        at = start[0]

        def body(txn: lmdb.Transaction) -> None:
            cur = txn.cursor(db=self.rows_db)
            keys, vals = [], []
            if cur.set_range(at) if at else cur.first():
                for k, v in cur:
                    keys.append(k)
                    vals.append(v)
                    if len(keys) == MIGRATE_CHUNK:
                        break
            if not keys:
                start[0] = None
                return
            if any(len(k) != 12 for k in keys):
                raise StoreFormatError(self.path, "corrupt version-1 store: a key is not 12 bytes")
            kv = np.frombuffer(b"".join(keys), dtype=KEY_DTYPE_V1)
            t, ids = kv["t"].astype(np.int64), kv["k"].astype(np.uint64)
            if int(t.max()) >= ntables:
                raise StoreFormatError(self.path, f"corrupt version-1 store: a row of table {int(t.max())}, "
                                                  f"but it has {ntables} tables")
            cuts = np.flatnonzero(np.diff(t)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(t)]):
                added = txn.cursor(db=self._dbs[int(t[a])]).putmulti(
                    zip(key_list(ids[a:b]), vals[a:b]), append=True)[1]
                if added != b - a:
                    raise StoreFormatError(self.path, "corrupt version-1 store: its keys are out of order")
            nxt = int.from_bytes(keys[-1], "big") + 1
            start[0] = nxt.to_bytes(12, "big") if len(keys) == MIGRATE_CHUNK and nxt < 1 << 96 else None
        return body

    # -- metadata ---------------------------------------------------------------
    def read_meta(self) -> dict | None:
        """The store's layout, or None for a fresh environment."""
        try:
            raw = self.snapshot_read(lambda txn: txn.get(META_KEY, db=self.meta_db), "metadata read")
        except (StoreIOError, StoreFormatError):
            raise
        except HierMemError as e:
            raise StoreFormatError(self.path, f"cannot read store metadata: {e}") from e
        if raw is None:
            if not self._fresh:
                raise StoreFormatError(self.path, "a hiermem-shaped LMDB environment without store metadata")
            return None
        return parse_meta(self.path, raw, version=self.version)

    _meta_bytes = staticmethod(meta_bytes)

    # -- rows -------------------------------------------------------------------
    def read(self, table: int, ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Records of ``ids`` of one table: ``(found bool[n], records float32[n, width])``.

        Rows not found are left zero in ``records``; duplicate ids get the same record.
        Queued and combined write-backs win over LMDB (a row's newest record is its value).
        """
        queued = {}
        if self.write_behind:  # else nothing is ever queued
            queued = queued_by_table(self.queue.snapshot())  # before reading LMDB: a batch committed meanwhile is still here
        found, out = self._read(table, ids, width)
        self._newer(table, ids, width, found, out, queued)
        return found, out

    def read_many(self, groups: list[tuple[int, np.ndarray, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`read` of ``(table, ids, width)`` groups, each table's once: the read-ahead
        cache first, then one LMDB read (one transaction, or one request to this thread's
        I/O process) for what it did not hold of every table (a step's misses span many
        tables; a transaction or a round trip and the calls around it cost about as much
        as reading 30 rows)."""
        if len(groups) < 2 and not len(self.ahead):
            return [self.read(t, ids, w) for t, ids, w in groups]
        self._check_version()
        queued = queued_by_table(self.queue.snapshot()) if self.write_behind else {}  # before LMDB: see read
        plan = []  # (table, sorted distinct keys, order, inverse, width, found, records) in sorted-key order
        for table, ids, width in groups:
            _, su, order, inverse = sorted_keys(ids)
            plan.append((table, su, order, inverse, width, np.zeros(len(su), dtype=bool),
                         np.zeros((len(su), width), dtype=np.float32)))
        ask = []  # (plan index, positions of the keys left for LMDB, or None: all, database)
        for i, (table, su, _, _, _, f, r) in enumerate(plan):
            if not len(su):
                continue
            rest = None
            if len(self.ahead):
                got = self.ahead.lookup(table, su, f, r)
                if got.all():
                    continue
                rest = np.flatnonzero(~got) if got.any() else None
            db = self.table_database(table)
            if db is not None:  # else nothing of the table was ever written
                ask.append((i, rest, db))
        if ask:
            keys = [plan[i][1] if rest is None else plan[i][1][rest] for i, rest, _ in ask]
            by_proc = (self._proc_read([(plan[i][0], k, plan[i][4]) for (i, _, _), k in zip(ask, keys)])
                       if _background() else None)  # by this thread's I/O process
            if by_proc is None:
                def fn(txn: lmdb.Transaction) -> list:
                    return [txn.cursor(db=db).getmulti(key_list(k)) for (_, _, db), k in zip(ask, keys)]
                t0 = time.perf_counter()
                res = self.snapshot_read(fn)
                self._observe(self.read_seconds, t0)
                for (i, rest, _), k, one in zip(ask, keys, res):
                    table, _, _, _, width, f, r = plan[i]
                    self.parse_records(one, table, width, k, rest, f, r)
            else:
                for (i, rest, _), got in zip(ask, by_proc):
                    _scatter(got, rest, plan[i][5], plan[i][6])
        out = []
        for table, su, order, inverse, width, f, r in plan:
            self._newer(table, su, width, f, r, queued)  # each distinct key once
            if order is not None:  # distinct, unsorted ids: back to their positions
                fo, ro = np.empty_like(f), np.empty_like(r)
                fo[order], ro[order] = f, r
                f, r = fo, ro
            elif inverse is not None:
                f, r = f[inverse], r[inverse]
            out.append((f, r))
        return out

    def _newer(self, table: int, ids: np.ndarray, width: int, found: np.ndarray, out: np.ndarray,
               queued: dict[int, list[tuple[np.ndarray, np.ndarray]]]) -> None:
        """Records of ``ids`` newer than LMDB's into ``found``/``out``: those of the write-behind
        ``queued`` batches (:func:`queued_by_table`; oldest first: the newest wins), then
        those combined."""
        groups = queued.get(table)
        if groups and len(ids):
            u = id_keys(ids)
            for qids, qrec in groups:  # one compiled pass per queued group of the table
                take_queued(qids, qrec, u, min(width, qrec.shape[1]), found, out)
        if self.combine is not None:
            self.combine.lookup(table, ids, width, found, out)

    def _read(self, table: int, ids: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read` from the read-ahead cache and LMDB (the queue aside)."""
        n = len(ids)
        found = np.zeros(n, dtype=bool)
        out = np.zeros((n, width), dtype=np.float32)
        if n == 0:
            return found, out
        self._check_version()
        u, su, order, inverse = sorted_keys(ids)
        if inverse is not None:  # each distinct id once, then expand
            f, r = self._read(table, su, width)
            return f[inverse], r[inverse]
        if self.ahead:
            got = self.ahead.lookup(table, u, found, out)
            if got.all():
                return found, out
            if got.any():  # read the rest
                rest = ~got
                f, r = self._read(table, u[rest], width)
                found[rest], out[rest] = f, r
                return found, out
        db = self.table_database(table)
        if db is None:  # nothing of the table was ever written
            return found, out
        got = self._proc_read([(table, su, width)]) if _background() else None
        if got is not None:  # by this thread's I/O process
            _scatter(got[0], order, found, out)
            return found, out
        keys = key_list(su)
        t0 = time.perf_counter()
        res = self.snapshot_read(lambda txn: txn.cursor(db=db).getmulti(keys))
        self._observe(self.read_seconds, t0)
        self.parse_records(res, table, width, su, order, found, out)
        return found, out

    def snapshot_read(self, fn: Callable[[lmdb.Transaction], object], doing: str = "read"):
        """``fn(txn)`` in one read transaction (a snapshot of the last commit).

        A map grown by another process is adopted; an I/O error is retried
        (:func:`~hiermem.tiers.ioerrors.retry_read`).

        Raises:
            StoreIOError: the read failed in the OS every time (with its errno).
            StoreFormatError: LMDB found the file corrupt.
        """
        def attempt():
            for _ in range(3):
                try:
                    with self.env.begin(buffers=False) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:  # a writer in another process grew the map
                    self.env.set_mapsize(0)
            raise HierMemError(f"{self.path}: LMDB map resized repeatedly during a {doing}")
        return retry_read(self.path, attempt, doing)

    def parse_records(self, res, table, width, sids, order, found, out) -> None:
        """Fill ``found``/``out`` from getmulti's ``res`` for the sorted ids ``sids``, at
        ``order``'s positions (None: ``sids`` are the positions' own order)."""
        if not res:
            return
        raw = b"".join(map(_VALUE, res))
        rec = parse_values(self.path, table, raw, len(res), width)
        if len(res) == len(sids):  # every row found (the usual case): no key to match
            pos = slice(None) if order is None else order
        else:
            pos = np.searchsorted(sids, decode_keys(b"".join(map(_KEY, res))))
            if order is not None:
                pos = order[pos]
        found[pos] = True
        out[pos] = rec
        self.bytes_read += len(raw)

    def durations(self) -> tuple[Histogram, Histogram]:
        """Copies of the read and write duration histograms."""
        with self._timing:
            return self.read_seconds.copy(), self.write_seconds.copy()

    def _observe(self, hist: Histogram, t0: float) -> None:
        with self._timing:
            hist.observe(time.perf_counter() - t0)

    # -- read-ahead (the cache is :attr:`ahead`) --------------------------------
    def begin_read_ahead(self) -> int:
        """:meth:`ReadAhead.begin`: open a read-ahead; returns its token."""
        return self.ahead.begin()

    def read_ahead(self, groups: list[tuple[int, np.ndarray, int]], token: int, keep: int | None = None) -> int:
        """:meth:`ReadAhead.read`: read ``(table, ids, width)`` groups into the cache,
        without the store's lock; returns the records kept."""
        return self.ahead.read(groups, token, keep)

    def drop_read_ahead(self) -> None:
        """Forget every read-ahead record (a pipeline that stops reading ahead): reads and
        writes then skip the cache's lookups.  Waits for a read-ahead still reading."""
        self.ahead.clear(wait=True)

    @property
    def ahead_rows(self) -> int:
        """Records read ahead and kept."""
        return self.ahead.rows

    @property
    def ahead_hits(self) -> int:
        """Reads served from read-ahead records."""
        return self.ahead.hits

    def _proc_read(self, groups: list[tuple[int, np.ndarray, int]]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Records of ``(table, sorted distinct uint64 ids, width)`` groups in one snapshot
        by this thread's I/O process (GIL-free: the thread waits on a pipe), or None: it
        has none, or it failed (the caller reads in-thread, which types the error)."""
        proc = self._proc(write=False)
        if proc is None:
            return None
        t0 = time.perf_counter()
        try:
            got = proc.read(groups)
        except LmdbProcessError as e:
            self.procs.failed(proc, e)
            return None
        self._observe(self.read_seconds, t0)
        for found, rec in got:
            self.bytes_read += int(found.sum()) * rec.shape[1] * 4
        return got

    def _read_groups(self, groups: list[tuple[int, np.ndarray, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Records of ``(table, sorted distinct uint64 ids, width)`` groups in one snapshot,
        by this thread's I/O process where it has one: ``[(found, records)]``."""
        got = self._proc_read(groups)
        if got is not None:
            return got
        dbs = [self.table_database(table) for table, _, _ in groups]  # before the transaction: opening one takes its own
        out = []
        with self.env.begin(buffers=False) as txn:
            for (table, ids, width), db in zip(groups, dbs):
                found = np.zeros(len(ids), dtype=bool)
                rec = np.zeros((len(ids), width), dtype=np.float32)
                if db is not None and len(ids):
                    t0 = time.perf_counter()
                    res = txn.cursor(db=db).getmulti(key_list(ids))
                    self._observe(self.read_seconds, t0)
                    self.parse_records(res, table, width, ids, None, found, rec)
                out.append((found, rec))
        return out

    # -- write-behind (the queue is :attr:`queue`) -------------------------------
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
        self.queue.put(q)
        self.ahead.written([(t, ids) for t, ids, _ in q.groups])  # LMDB's copies are going stale
        self.bytes_written += q.nbytes
        return q.nbytes

    def enqueue_rows(self, t: np.ndarray, k: np.ndarray, rec: np.ndarray, widths: list[int],
                     meta: Callable[[], dict] | None = None) -> int:
        """An eviction write-back of rows ``(t, k)`` (int64 ``[n]``) with records ``rec``
        (float32 ``[n, W]``, table ``t``'s first ``widths[t]`` columns): combined with
        others (:attr:`combine`; committed when the limit would be passed, and with the
        next :meth:`write`), else :meth:`enqueue`'d.  ``meta()``: the metadata written
        with the commit.  Returns the bytes of records.

        Raises:
            DiskFullError, StoreIOError: the commit this write-back needed failed;
                nothing of this call was written or held.
        """
        c = self.combine
        if c is None or not c.room(len(k)):
            if c is not None and c.n:  # what is held first, with this write-back in its transaction
                if self.write_behind:  # one queued batch for the writer thread: held rows, then these
                    held = c.groups()
                    n = self.enqueue(held + table_groups(t, k, rec, widths), meta=None if meta is None else meta())
                    c.clear()
                    return n - sum(r.nbytes for _, _, r in held)
                return self.write(table_groups(t, k, rec, widths), meta=None if meta is None else meta())
            return self.enqueue(table_groups(t, k, rec, widths), meta=None if meta is None else meta())
        c.put(t, k, rec, widths)
        return self._nbytes(t, widths)

    @staticmethod
    def _nbytes(t: np.ndarray, widths: list[int]) -> int:
        return int(np.asarray(widths, np.int64)[t].sum()) * 4 if len(t) else 0

    def drain(self) -> None:
        """Wait until every queued write-back is committed (:meth:`WriteQueue.drain`)."""
        self.queue.drain()

    @property
    def queued(self) -> int:
        """Rows in queued write-backs."""
        return self.queue.rows

    @property
    def combined(self) -> int:
        """Rows held by :attr:`combine` for a later commit."""
        return self.combine.rows if self.combine is not None else 0

    def _commit_queued(self, q: _Queued) -> None:
        """The writer thread's commit of a queued write-back: by its I/O process, or here
        (no map growth: that needs every reader out; the caller's retry does it)."""
        proc = self._proc(write=True)
        if proc is not None:
            try:
                self._proc_write(proc, q)
            except LmdbProcessError as e:
                self.procs.failed(proc, e)
                raise
        else:
            with self.env.begin(write=True) as txn:
                self._txn_body(q)(txn)

    @staticmethod
    def _proc_write(proc: LmdbProcess, q: _Queued) -> None:
        """Commit a queued write-back in the writer thread's I/O process."""
        proc.write(q.groups, q.meta_raw)

    def _committed(self, q: _Queued, t0: float) -> None:
        self.ahead.written([(t, ids) for t, ids, _ in q.groups])  # a read-ahead open meanwhile drops them
        self._observe(self.write_seconds, t0)

    # -- I/O processes (:attr:`procs`) ------------------------------------------
    def _proc(self, write: bool) -> LmdbProcess | None:
        """This thread's I/O process over the current map, or None: do the I/O here."""
        return self.procs.get(write, self.map_size, self.writemap)

    @property
    def io_process(self) -> bool:
        """Background LMDB work goes through child processes (until they failed thrice)."""
        return self.procs.enabled

    @property
    def io_failures(self) -> int:
        """I/O processes that failed to start or died."""
        return self.procs.failures

    @property
    def io_processes(self) -> int:
        """I/O processes running now (one per background thread that used one)."""
        return self.procs.running

    def write(self, groups: Iterable[tuple[int, np.ndarray, np.ndarray]], meta: dict | None = None,
              sync: bool = False) -> int:
        """Write ``(table, ids, records)`` groups (and ``meta``) in one transaction.

        Rows held by :attr:`combine` are written first, in the same transaction.

        Returns the number of bytes of ``groups``' records written.

        Raises:
            DiskFullError: the disk is full; the transaction was aborted (rows held by
                :attr:`combine` are still held).
        """
        self.drain()  # queued write-backs first: a later write of a row must win
        held = self.combine.groups() if self.combine is not None else []
        q = self._prepare(held + list(groups), meta)  # combined rows first: the later put wins

        t0 = time.perf_counter()
        self._write_txn(self._txn_body(q), q.nbytes)
        if held:
            self.combine.clear()
        if q.groups:
            self.ahead.written([(t, ids) for t, ids, _ in q.groups])
        if sync:
            self.sync()
        self._observe(self.write_seconds, t0)
        self.bytes_written += q.nbytes
        return q.nbytes - sum(rec.nbytes for _, _, rec in held)

    def _prepare(self, groups, meta: dict | None) -> _Queued:
        self._check_version()
        out, nbytes = [], 0
        for table, ids, rec in groups:
            if len(ids) == 0:
                continue
            rec = np.ascontiguousarray(rec, dtype="<f4")
            u = id_keys(ids)
            if len(u) > 1 and not bool((u[1:] > u[:-1]).all()):
                order = np.argsort(u, kind="stable")  # in key order the B-tree's pages stay hot
                u, rec = u[order], rec[order]
            self.table_database(table, create=True)  # a table's first write makes its database (outside any transaction)
            out.append((table, u, rec))
            nbytes += rec.nbytes
        return _Queued(out, None if meta is None else self._meta_bytes(meta), nbytes)

    def _txn_body(self, q: _Queued) -> Callable[[lmdb.Transaction], None]:
        def body(txn: lmdb.Transaction) -> None:
            for table, ids, rec in q.groups:
                put_sorted(txn.cursor(db=self._dbs[table]), ids, rec)
            if q.meta_raw is not None:
                txn.put(META_KEY, q.meta_raw, db=self.meta_db)
        return body

    def _write_txn(self, body: Callable[[lmdb.Transaction], None], nbytes: int = 0) -> None:
        """Run ``body`` in one write transaction and commit it: growing a full map, and
        once more after an I/O error (LMDB aborted the transaction whole, so a retry
        writes it exactly once).

        Raises:
            DiskFullError: the disk is full (nothing written).
            StoreIOError: an I/O error, twice (nothing written).
        """
        if self.readonly:
            raise HierMemError(f"{self.path}: the disk tier is open read-only")
        failures = 0
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    body(txn)
                return
            except lmdb.MapFullError:
                with self.ahead.idle():  # no transaction may be open while the map is resized
                    size = grow_map(self.path, self.map_size) if self.writemap else self.map_size * 2
                    self.env.set_mapsize(size)
                    self.map_size = size
            except lmdb.Error as e:
                if _disk_full(self.path, e, nbytes):
                    raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full; the write was not made ({e})") from e
                err = typed(self.path, e, "write", nbytes)
                failures += 1
                if not isinstance(err, StoreIOError) or failures >= COMMIT_ATTEMPTS:
                    raise err from e

    def clear_rows(self, meta: dict | None = None, sync: bool = True) -> None:
        """Delete every row (one transaction), keeping the environment and its metadata;
        then sync it to disk (without ``sync``: the caller calls :meth:`sync`)."""
        self.drain()
        meta_raw = None if meta is None else self._meta_bytes(meta)

        def body(txn: lmdb.Transaction) -> None:
            for db in self._dbs.values():
                txn.drop(db, delete=False)
            if meta_raw is not None:
                txn.put(META_KEY, meta_raw, db=self.meta_db)

        self._write_txn(body)
        if self.combine is not None:
            self.combine.clear()
        self.ahead.clear()
        if sync:
            self.sync()

    def sync(self) -> None:
        """Force committed data to disk (flush, checkpoint); first clear the reader slots of
        dead processes (a killed read-only handle), so their old snapshots do not keep LMDB
        from reusing pages."""
        try:
            self.env.reader_check()
        except lmdb.Error:
            pass
        try:
            self.env.sync(True)
        except lmdb.Error as e:  # never retried: after a failed fsync the kernel may have dropped the pages
            if _disk_full(self.path, e):
                raise DiskFullError(errno.ENOSPC, f"{self.path}: disk full during sync ({e})") from e
            raise typed(self.path, e, "sync") from e

    def count(self) -> int:
        """Rows of the disk tier, every table's: in LMDB, and held by :attr:`combine`
        not yet in LMDB."""
        dbs = list(self._dbs.values()) if self.version == FORMAT_VERSION else [self.rows_db]
        held = self.combine.keys() if self.combine is not None else []

        def fn(txn: lmdb.Transaction) -> int:
            n = sum(txn.stat(db)["entries"] for db in dbs)
            for table, ids in held:  # rows written for the first time are not in LMDB yet
                db = self._dbs.get(table)
                n += len(ids) - (len(txn.cursor(db=db).getmulti(key_list(id_keys(ids)))) if db is not None else 0)
            return n
        return self.snapshot_read(fn, "stat")

    def close(self) -> None:
        """Close the environment.  Queued write-backs not yet committed are dropped: the
        store drains the queue (flush) before closing."""
        self.queue.stop()
        self.ahead.clear(wait=True)  # a read-ahead still reading (another thread) finishes first
        self.procs.close()
        self.env.close()
