"""Record format and keys of the disk tier's LMDB environment.

Format version 2 (this one): one LMDB sub-database per table, named ``t<index>``
(:func:`table_db`) and opened with ``integerkey=True``; a key is the row id as a
native-endian ``uint64`` (8 bytes; LMDB compares keys as integers, so numpy's sorted ids
are LMDB's order and a batch's keys are one ``view`` of its id array); a value is the
row's record (weights then optimizer state, the table's own width: ``dim +
state_width(dim)`` floats) as little-endian float32, every value of a table the same
size.  A sub-database ``meta`` holds the store's layout as JSON under ``META_KEY``, with
the format marker and version.

Format version 1 (before): one sub-database ``rows`` for every table, 12-byte big-endian
``(table u32, id u64)`` keys compared as bytes, the same values.  A writable open
migrates it (:meth:`hiermem.tiers.disk.DiskTier._migrate_v1`); a read-only one refuses
it with :class:`~hiermem.errors.StoreVersionError`, as every open refuses a version it
does not know.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from ..core.jit import tiny
from ..errors import StoreFormatError, StoreVersionError

META_KEY = b"store"
META_DB = b"meta"
ROWS_DB_V1 = b"rows"  # version 1's one database of every table's rows
FORMAT = "hiermem-store"
FORMAT_VERSION = 2
KEY_DTYPE = np.dtype("=u8")  # a key: the row id, native-endian (LMDB's integerkey)
KEY_DTYPE_V1 = np.dtype([("t", ">u4"), ("k", ">u8")])
_TABLE_DB = re.compile(rb"t(0|[1-9][0-9]{0,8})")


def table_db(table: int) -> bytes:
    """The name of table ``table``'s sub-database."""
    return b"t%d" % table


def table_of_db(name: bytes) -> int | None:
    """The table index of a sub-database name (None: not a table's)."""
    m = _TABLE_DB.fullmatch(name)
    return None if m is None else int(m.group(1))


def id_keys(ids) -> np.ndarray:
    """Row ids as contiguous native ``uint64`` (the keys' integers; sort them for LMDB)."""
    return np.ascontiguousarray(np.asarray(ids).astype(np.uint64, copy=False))


@tiny
def lower_bound(keys, x):
    """The first position of sorted ``keys`` (uint64) whose key is not below ``x``
    (``keys.size`` when none is): compiled, inlined into the kernels that look keys up."""
    lo, hi = 0, keys.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def key_list(ids: np.ndarray) -> list[bytes]:
    """``uint64`` ids as a list of 8-byte keys (``V8``: ``S`` would drop trailing zeros)."""
    return np.ascontiguousarray(ids, dtype=KEY_DTYPE).view("V8").tolist()


def decode_keys(raw: bytes) -> np.ndarray:
    """Concatenated 8-byte keys as ``uint64`` ids."""
    return np.frombuffer(raw, dtype=KEY_DTYPE)


EXPORT_CHUNK = 1 << 16  # records converted per step of a table's export


def table_records(path, txn, db, table: int, width: int, chunk: int = EXPORT_CHUNK):
    """Every record of table ``table`` (its sub-database ``db``) in the read transaction
    ``txn`` (opened with ``buffers=False``), in id order: ``(ids int64 [m], records
    float32 [m, width])`` chunks of at most ``chunk`` rows.

    Raises:
        StoreFormatError: a value is not ``width`` little-endian floats (a corrupt store).
    """
    keys, vals = [], []
    for k, v in txn.cursor(db=db):
        keys.append(k)
        vals.append(v)
        if len(keys) == chunk:
            yield _chunk(path, table, keys, vals, width)
            keys, vals = [], []
    if keys:
        yield _chunk(path, table, keys, vals, width)


def _chunk(path, table: int, keys: list, vals: list, width: int) -> tuple[np.ndarray, np.ndarray]:
    raw = b"".join(vals)
    ids = decode_keys(b"".join(keys)).astype(np.int64)
    return ids, parse_values(path, table, raw, len(vals), width).astype(np.float32)


def parse_values(path, table: int, raw: bytes, n: int, width: int) -> np.ndarray:
    """``n`` records of table ``table`` joined in ``raw`` as a read-only float32 view
    ``[n, width]``.  Raises StoreFormatError (naming ``path``) when ``raw`` is not ``n``
    records of ``width`` floats: a corrupt store."""
    if len(raw) != n * width * 4:
        raise StoreFormatError(path, f"corrupt store: table {table} records are not {width} floats")
    return np.frombuffer(raw, dtype="<f4").reshape(n, width)


def concat_records(chunks: list, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of :func:`table_records` as one ``(ids, records)`` pair."""
    if not chunks:
        return np.empty(0, dtype=np.int64), np.empty((0, width), dtype=np.float32)
    return np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])


def value_list(rec: np.ndarray) -> list[bytes]:
    """Records ``[n, w]`` as a list of ``4 * w``-byte little-endian float32 values."""
    rec = np.ascontiguousarray(rec, dtype="<f4")
    return rec.view(f"V{rec.shape[1] * 4}").reshape(len(rec)).tolist()


def encode_keys_v1(t: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Version 1 keys as an ``S12`` array (for migrating and for tests of it)."""
    a = np.empty(len(k), dtype=KEY_DTYPE_V1)
    a["t"] = t
    a["k"] = k
    return a.view("S12")


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


def meta_bytes(meta: dict) -> bytes:
    """The metadata value: ``meta`` with the format marker and (this) version."""
    return json.dumps({**meta, "format": FORMAT, "version": FORMAT_VERSION}, sort_keys=True).encode()


def parse_meta(path, raw: bytes, version: int = FORMAT_VERSION) -> dict:
    """The metadata value ``raw`` of the store at ``path`` as a dict; its version must be
    ``version`` (the one its databases have).

    Raises:
        StoreVersionError: a version this hiermem does not know.
        StoreFormatError: not JSON, not a hiermem store, or a version its databases do
            not have.
    """
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise StoreFormatError(path, f"corrupt store metadata: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StoreFormatError(path, "not a hiermem store (bad format marker)")
    have = meta.get("version")
    if have not in (1, FORMAT_VERSION):
        raise StoreVersionError(path, have, f"store format version {have!r} is not one this hiermem reads "
                                            f"(it reads {FORMAT_VERSION} and migrates 1); written by a newer hiermem?")
    if have != version:
        raise StoreFormatError(path, f"corrupt store: its metadata says format version {have}, its databases "
                                     f"are version {version}'s")
    return meta


def refuse_v1(path, doing: str):
    """The :class:`StoreVersionError` for a version-1 store that ``doing`` cannot migrate."""
    return StoreVersionError(path, 1, f"store format version 1 (one 'rows' database, 12-byte keys) is older than "
                                      f"this hiermem's version {FORMAT_VERSION}; {doing} cannot migrate it: open it "
                                      f"once for writing (HierarchicalStore.open), which migrates it in place")
