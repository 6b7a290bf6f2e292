"""The LMDB I/O process: reads or commits batches of records for a store's disk tier.

Run by :class:`hiermem.tiers.lmdb_process.LmdbProcess` as ``python _lmdb_server.py PATH
MAP_SIZE MODE SYNC PARENT WRITEMAP MAX_DBS`` (MODE ``r``: reads only; ``w``: write
transactions too, through the shared map when WRITEMAP is 1, the parent having allocated
the file).  The store is format version 2 (:mod:`hiermem.tiers.records`): a database
``t<table>`` per table, native ``uint64`` integer keys.  It imports
only lmdb and numpy (not torch, not hiermem), so it starts in a fraction of a second.

Why a process: py-lmdb holds the GIL through ``getmulti``, ``putmulti`` and commit, so
LMDB work on a thread of the training process stalls every other thread of it; here it
runs on another core.  LMDB is built for several processes on one environment: readers
see committed transactions, writers are serialised by LMDB's own lock.

Protocol (binary, framed; no pickle) on stdin/stdout: a request is one op byte, a u64
length and a payload; a reply is one status byte (0 ok, 1 map full, 2 error), a u64
length and a payload (an error's payload is its message).

- ``R`` read: u32 groups; each u32 table, u32 width (floats), u64 n, then n sorted
  distinct u64 ids.  Reply: per group n found bytes (0/1), then n * width float32
  records (zero where not found).
- ``W`` write (one transaction): u32 groups; each u32 table, u32 record bytes, u64 n, n
  sorted distinct ids, n records; then u32 meta length and the meta value.  Reply: empty.
- ``Q`` quit.

A map that is full is reported (the store grows it in its own process and commits
there); a map grown by another process is adopted.  The process dies with the thread
that started it (Linux ``PR_SET_PDEATHSIG``), so a killed trainer leaves no commit
running behind it.
"""

import os
import struct
import sys

META_DB, META_KEY = b"meta", b"store"
_HDR = struct.Struct("<cQ")
_REPLY = struct.Struct("<BQ")


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def _read_exact(f, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _reply(out, status: int, payload: bytes = b"") -> None:
    out.write(_REPLY.pack(status, len(payload)))
    if payload:
        out.write(payload)
    out.flush()


class _Dbs:
    """Each table's database, opened on first use (None: the table has none yet)."""

    def __init__(self, env, lmdb):
        self.env, self.lmdb, self.dbs = env, lmdb, {}

    def __call__(self, table: int):
        if table not in self.dbs:
            try:
                self.dbs[table] = self.env.open_db(b"t%d" % table, create=False, integerkey=True)
            except self.lmdb.NotFoundError:
                return None
        return self.dbs[table]


def _read(env, dbs, np, raw: bytes) -> bytes:
    (ngroups,) = struct.unpack_from("<I", raw, 0)
    off, groups, out = 4, [], []
    for _ in range(ngroups):
        table, width, n = struct.unpack_from("<IIQ", raw, off)
        off += 16
        groups.append((dbs(table), width, np.frombuffer(raw, dtype=np.uint64, count=n, offset=off)))
        off += 8 * n
    with env.begin(buffers=False) as txn:
        for db, width, ids in groups:
            n = len(ids)
            found = np.zeros(n, dtype=np.uint8)
            rec = np.zeros((n, width), dtype="<f4")
            res = txn.cursor(db=db).getmulti(ids.view("V8").tolist()) if db is not None and n else []
            if res:
                recs = b"".join([kv[1] for kv in res])
                if len(recs) != len(res) * width * 4:
                    raise ValueError(f"corrupt store: records are not {width} floats")
                if len(res) == n:
                    found[:] = 1
                    rec[:] = np.frombuffer(recs, dtype="<f4").reshape(n, width)
                else:
                    pos = np.searchsorted(ids, np.frombuffer(b"".join([kv[0] for kv in res]), dtype=np.uint64))
                    found[pos] = 1
                    rec[pos] = np.frombuffer(recs, dtype="<f4").reshape(len(res), width)
            out += [found.tobytes(), rec.tobytes()]
    return b"".join(out)


def _put_sorted(cur, np, ids, vals) -> None:
    """As ``hiermem.tiers.disk.put_sorted``: ids past the last key appended."""
    split = 0
    if cur.last():
        split = int(np.searchsorted(ids, np.frombuffer(cur.key(), dtype=np.uint64)[0], side="right"))
    keys = ids.view("V8").tolist()
    if split:
        cur.putmulti(zip(keys[:split], vals[:split]))
    if split < len(ids) and cur.putmulti(zip(keys[split:], vals[split:]), append=True)[1] != len(ids) - split:
        raise ValueError("LMDB refused appended keys: ids not distinct and ascending")


def _write(env, dbs, np, meta_db, raw: bytes) -> None:
    (ngroups,) = struct.unpack_from("<I", raw, 0)
    off, groups = 4, []
    for _ in range(ngroups):
        table, rb, n = struct.unpack_from("<IIQ", raw, off)
        off += 16
        ids = np.frombuffer(raw, dtype=np.uint64, count=n, offset=off)
        off += 8 * n
        vals = np.frombuffer(raw, dtype=f"V{rb}", count=n, offset=off).tolist()  # n values of rb bytes
        off += rb * n
        db = dbs(table)
        if db is None:
            raise ValueError(f"table {table} has no database")
        groups.append((db, ids, vals))
    (mlen,) = struct.unpack_from("<I", raw, off)
    meta = raw[off + 4:off + 4 + mlen] if mlen else None
    with env.begin(write=True) as txn:
        for db, ids, vals in groups:
            _put_sorted(txn.cursor(db=db), np, ids, vals)
        if meta is not None:
            txn.put(META_KEY, meta, db=meta_db)


def main(argv) -> int:
    path, map_size, mode, sync, parent = argv[1], int(argv[2]), argv[3], argv[4] == "1", int(argv[5])
    writemap = mode == "w" and argv[6] == "1"  # the parent allocated the file up to map_size
    max_dbs = int(argv[7])
    _die_with_parent(parent)
    import lmdb
    import numpy as np

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the reply channel
    try:
        env = lmdb.open(path, map_size=map_size, max_dbs=max_dbs, readahead=False, meminit=False, create=False,
                        sync=sync, readonly=mode == "r", writemap=writemap)
        meta_db = env.open_db(META_DB, create=False)
        dbs = _Dbs(env, lmdb)
    except Exception as e:  # the store sees the failed start and does its I/O itself
        _reply(out, 2, f"cannot open {path}: {e}".encode())
        return 1
    _reply(out, 0, b"hiermem-lmdb")
    while True:
        try:
            op, n = _HDR.unpack(_read_exact(inp, _HDR.size))
            raw = _read_exact(inp, n)
        except EOFError:
            return 0
        if op == b"Q":
            return 0
        for _attempt in range(3):
            try:
                if op == b"R":
                    _reply(out, 0, _read(env, dbs, np, raw))
                elif op == b"W" and mode == "w":
                    _write(env, dbs, np, meta_db, raw)
                    _reply(out, 0)
                else:
                    _reply(out, 2, f"bad request {op!r}".encode())
                break
            except lmdb.MapResizedError:  # another process grew the map: adopt its size
                env.set_mapsize(0)
            except lmdb.MapFullError:
                _reply(out, 1, b"map full")
                break
            except Exception as e:
                _reply(out, 2, f"{type(e).__name__}: {e}".encode())
                break
        else:
            _reply(out, 2, b"map resized repeatedly")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
