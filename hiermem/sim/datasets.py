"""Importers: raw id streams and the shared data sets (Criteo head, MovieLens) as traces.

Each writes a trace in the format of :mod:`hiermem.observe.trace`; the data files are read
in place from the shared data folder (``$HIERMEM_DATA``), never copied.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

import numpy as np

from ..errors import InvalidArgumentError
from ..nn.data import shared_data_dir
from ..observe.trace import bad_trace, write_trace


def _batched_lens(n: int, batch_size: int) -> np.ndarray:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    full, rest = divmod(n, batch_size)
    return np.array([batch_size] * full + ([rest] if rest else []), dtype=np.int64).reshape(-1, 1)


def import_npy(src: str | os.PathLike, out: str | os.PathLike, table: str, batch_size: int,
               updates: bool = True) -> Path:
    """Wrap a raw 1-D integer id stream (a ``.npy`` file) as a one-table trace.

    Raises:
        TraceFormatError: ``src`` is not a readable ``.npy`` of non-negative integers.
    """
    src = Path(src)
    try:
        ids = np.load(src, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise bad_trace(src, f"not a readable .npy id array: {e}") from e
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise bad_trace(src, f"ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise bad_trace(src, "ids above 2**63-1")
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and int(ids.min()) < 0:
        raise bad_trace(src, "negative ids")
    return write_trace(out, [table], ids, _batched_lens(ids.size, batch_size), updates=updates,
                       source=f"npy:{src.name}")


def _per_table_batches(cols: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``cols [samples, T]`` (-1 = missing) -> flat ids table after table per batch, lens."""
    S, T = cols.shape
    nb = -(-S // batch_size)
    pad = nb * batch_size - S
    c = np.concatenate((cols, np.full((pad, T), -1, dtype=cols.dtype))) if pad else cols
    blocks = c.reshape(nb, batch_size, T).transpose(0, 2, 1)  # [batch, table, sample]
    keep = blocks >= 0
    return blocks[keep].astype(np.int64), keep.sum(2).astype(np.int64)


def import_criteo(out: str | os.PathLike, batch_size: int, data_dir: str | os.PathLike | None = None,
                  updates: bool = True) -> Path:
    """The shared Criteo head (``criteo-dac-head8k/cat_ids.npy``) as 26 tables C1..C26.

    ``batch_size`` counts samples; each batch holds every non-missing categorical id of
    its samples, table after table.  Read in place, never copied.
    """
    f = _shared(data_dir, "criteo-dac-head8k", "cat_ids.npy")
    cols = np.load(f, allow_pickle=False)
    if cols.ndim != 2 or cols.dtype.kind != "i":
        raise bad_trace(f, f"expected an int [samples, 26] array, got {cols.dtype} {cols.shape}")
    _batched_lens(1, batch_size)
    ids, lens = _per_table_batches(cols, batch_size)
    names = [f"C{i + 1}" for i in range(cols.shape[1])]
    return write_trace(out, names, ids, lens, updates=updates, source=f"criteo-dac-head8k/cat_ids.npy batch={batch_size}")


class MovieLensStream(enum.StrEnum):
    """Which MovieLens stream(s) to import (all sorted by rating time)."""

    ITEMS = "items"  #: movie ids: one table ``item``
    USERS = "users"  #: user ids: one table ``user``
    BOTH = "both"  #: tables ``user`` and ``item``, both ids of each rating in one batch


def import_movielens(out: str | os.PathLike, batch_size: int, stream: str = MovieLensStream.ITEMS,
                     data_dir: str | os.PathLike | None = None, updates: bool = True) -> Path:
    """The shared MovieLens ratings as a time-ordered trace (``items``, ``users`` or ``both``).

    movieIds are remapped to dense ids in order of first appearance (userIds are already
    dense from 1); ``batch_size`` counts ratings; ``both`` makes tables ``user`` and ``item``.
    """
    try:
        stream = MovieLensStream(stream)
    except ValueError:
        raise InvalidArgumentError(f"stream must be items, users or both, got {stream!r}") from None
    _batched_lens(1, batch_size)
    cols, names = [], []
    if stream in (MovieLensStream.USERS, MovieLensStream.BOTH):
        u = np.load(_shared(data_dir, "movielens-latest-small", "users_by_time.npy"), allow_pickle=False)
        cols.append(_dense_first_seen(u))
        names.append("user")
    if stream in (MovieLensStream.ITEMS, MovieLensStream.BOTH):
        it = np.load(_shared(data_dir, "movielens-latest-small", "items_by_time.npy"), allow_pickle=False)
        cols.append(_dense_first_seen(it))
        names.append("item")
    ids, lens = _per_table_batches(np.stack(cols, 1), batch_size)
    return write_trace(out, names, ids, lens, updates=updates,
                       source=f"movielens-latest-small/{stream} batch={batch_size}")


def _dense_first_seen(x: np.ndarray) -> np.ndarray:
    """Ids renumbered 0, 1, 2, ... in order of first appearance."""
    u, first, inv = np.unique(x, return_index=True, return_inverse=True)
    rank = np.empty(u.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(u.size)
    return rank[inv.reshape(-1)]


def _shared(data_dir, folder: str, name: str) -> Path:
    d = Path(data_dir) if data_dir is not None else shared_data_dir()
    f = d / folder / name if d is not None else None
    if f is None or not f.is_file():
        raise InvalidArgumentError(f"shared data file {folder}/{name} not found (set HIERMEM_DATA)")
    return f
