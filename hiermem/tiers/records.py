"""Record format and keys of the disk tier's LMDB environment.

Keys are 12 bytes, big-endian ``(table index u32, id u64)``, so LMDB's byte order is
numeric order.  A value is the row's record (weights then optimizer state, the table's
own width: ``dim + state_width(dim)`` floats) as little-endian float32.  A sub-database
``meta`` holds the store's layout as JSON under ``META_KEY``, with the format marker and
version.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import StoreFormatError

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
    """The metadata value: ``meta`` with the format marker and version."""
    return json.dumps({**meta, "format": FORMAT, "version": FORMAT_VERSION}, sort_keys=True).encode()


def parse_meta(path, raw: bytes) -> dict:
    """The metadata value ``raw`` of the store at ``path`` as a dict.

    Raises:
        StoreFormatError: not JSON, not a hiermem store, or another format version.
    """
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise StoreFormatError(path, f"corrupt store metadata: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StoreFormatError(path, "not a hiermem store (bad format marker)")
    if meta.get("version") != FORMAT_VERSION:
        raise StoreFormatError(path, f"store format version {meta.get('version')} is not {FORMAT_VERSION}")
    return meta
