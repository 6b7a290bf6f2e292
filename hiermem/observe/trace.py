"""Access traces: what training looked up, batch by batch and table by table.

Format (version 1), a directory::

    manifest.json            {"format": "hiermem-trace", "version": 1, "tables": [...],
                              "updates": true, "batches": B, "accesses": A,
                              "chunks": [{"ids": "c000000.ids.npy", "lens": "c000000.lens.npy",
                                          "batches": b, "accesses": a}, ...]}
    c000000.ids.npy          int64 [a]: the ids of the chunk's batches, batch after batch;
                             inside a batch, table after table (the KJT layout), each
                             table's ids in lookup order (duplicates kept)
    c000000.lens.npy         int64 [b, T]: ids of table ``t`` in batch ``i`` of the chunk
    c000000.tabs.npy         (optional, chunk key "tabs") int16 [a]: the table of each id;
                             when present the ids of each batch are in their lookup order
                             (tables interleaved, as a multi-table lookup issued them), which
                             the simulator needs for exact per-access recency

One *batch* is one accounted lookup of the store (one ``HierarchicalStore._place``): a
plain ``lookup`` of one table, or a multi-table lookup of a module.  ``updates`` says
that every batch was followed by an update of the same ids (a training trace), which is
what makes rows dirty in the simulator.

Writers stream: a chunk is written (``np.save``, then the manifest replaced atomically)
whenever ``chunk_accesses`` ids are buffered, so memory is bounded and a crashed writer
leaves a valid trace of its complete chunks.  Readers use ``allow_pickle=False`` and
check every chunk against the manifest; anything else raises :class:`TraceFormatError`
naming the file.
"""

from __future__ import annotations

import json
import os
import threading
import tokenize
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import InvalidArgumentError, InvalidTypeError, TraceFormatError

FORMAT = "hiermem-trace"
VERSION = 1
MANIFEST = "manifest.json"


class TraceWriter:
    """Stream batches to a trace directory with bounded memory.

    Args:
        path: the trace directory (created; must not already hold a trace).
        tables: table names, in the store's table order.
        updates: every batch is followed by an update of its ids (a training trace).
        chunk_accesses: ids buffered before a chunk is written.
        source: free-form provenance saved in the manifest.

    Thread-safety: ``add`` and ``close`` take the writer's lock.
    """

    def __init__(self, path: str | os.PathLike, tables: Sequence[str], updates: bool = True,
                 chunk_accesses: int = 1 << 20, source: str = ""):
        tables = list(tables)
        if not tables or not all(isinstance(t, str) for t in tables):
            raise InvalidArgumentError("tables must be a non-empty list of names")
        if not isinstance(chunk_accesses, int) or chunk_accesses <= 0:
            raise InvalidArgumentError(f"chunk_accesses must be a positive int, got {chunk_accesses!r}")
        self.path = Path(path)
        if (self.path / MANIFEST).exists():
            raise InvalidArgumentError(f"{self.path}: a trace is already there")
        self.path.mkdir(parents=True, exist_ok=True)
        self.tables = tables
        self.updates = bool(updates)
        self.chunk_accesses = chunk_accesses
        self.source = source
        self._lock = threading.Lock()
        self._ids: list[np.ndarray] = []
        self._lens: list[np.ndarray] = []
        self._tabs: list[np.ndarray | None] = []
        self._buffered = 0
        self._chunks: list[dict] = []
        self.batches = 0
        self.accesses = 0
        self.closed = False
        self._write_manifest()

    def add(self, per_table: Sequence[np.ndarray]) -> None:
        """Append one batch: ``per_table[t]`` are table ``t``'s ids (1-D int64, may be empty)."""
        if len(per_table) != len(self.tables):
            raise InvalidArgumentError(f"a batch needs {len(self.tables)} id arrays, got {len(per_table)}")
        arrs = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in per_table]
        self.add_flat(np.concatenate(arrs), np.array([a.size for a in arrs], dtype=np.int64))

    def add_flat(self, ids: np.ndarray, lens: np.ndarray, tabs: np.ndarray | None = None) -> None:
        """Append one batch given as its ids and ``lens [T]``: table after table, or in
        lookup order with ``tabs`` (the table of each id)."""
        with self._lock:
            if self.closed:
                raise InvalidArgumentError(f"{self.path}: trace writer is closed")
            self._ids.append(ids)
            self._lens.append(lens)
            self._tabs.append(tabs)
            self._buffered += ids.size
            self.batches += 1
            self.accesses += int(ids.size)
            if self._buffered >= self.chunk_accesses:
                self._flush_chunk()

    def add_stream(self, ids: np.ndarray, lens: np.ndarray) -> None:
        """Append many batches at once: ``ids`` flat, ``lens [b, T]`` (importers use this)."""
        lens = np.asarray(lens, dtype=np.int64).reshape(-1, len(self.tables))
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if int(lens.sum()) != ids.size:
            raise InvalidArgumentError("lens do not add up to the number of ids")
        ends = np.cumsum(lens.sum(1))
        start_b, start = 0, 0
        while start_b < lens.shape[0]:  # whole chunks, cut at batch boundaries
            stop_b = int(np.searchsorted(ends, start + self.chunk_accesses, side="left")) + 1
            stop_b = min(max(stop_b, start_b + 1), lens.shape[0])
            stop = int(ends[stop_b - 1])
            with self._lock:
                self._ids.append(ids[start:stop])
                self._lens.append(lens[start_b:stop_b])
                self._tabs.append(None)
                self._buffered += stop - start
                self.batches += stop_b - start_b
                self.accesses += stop - start
                if self._buffered >= self.chunk_accesses:
                    self._flush_chunk()
            start_b, start = stop_b, stop

    def _flush_chunk(self) -> None:
        if not self._ids:
            return
        n = len(self._chunks)
        ids = np.concatenate(self._ids)
        lens = np.concatenate([x.reshape(-1, len(self.tables)) for x in self._lens])
        name = f"c{n:06d}"
        np.save(self.path / f"{name}.ids.npy", ids, allow_pickle=False)
        np.save(self.path / f"{name}.lens.npy", lens, allow_pickle=False)
        entry = {"ids": f"{name}.ids.npy", "lens": f"{name}.lens.npy",
                 "batches": int(lens.shape[0]), "accesses": int(ids.size)}
        if any(x is not None for x in self._tabs):
            T = np.arange(len(self.tables), dtype=np.int16)
            tabs = np.concatenate([x.astype(np.int16) if x is not None else np.repeat(np.tile(T, ln.size // T.size),
                                                                                      ln.reshape(-1))
                                   for x, ln in zip(self._tabs, self._lens)])
            np.save(self.path / f"{name}.tabs.npy", tabs, allow_pickle=False)
            entry["tabs"] = f"{name}.tabs.npy"
        self._chunks.append(entry)
        self._ids, self._lens, self._tabs, self._buffered = [], [], [], 0
        self._write_manifest()

    def _write_manifest(self) -> None:
        doc = {"format": FORMAT, "version": VERSION, "tables": self.tables, "updates": self.updates,
               "batches": sum(c["batches"] for c in self._chunks),
               "accesses": sum(c["accesses"] for c in self._chunks), "chunks": self._chunks,
               "source": self.source}
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.path / MANIFEST)

    def close(self) -> Path:
        """Write the last chunk and the final manifest.  Idempotent; returns the path."""
        with self._lock:
            if not self.closed:
                self._flush_chunk()
                self.closed = True
        return self.path

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TraceRecorder(TraceWriter):
    """A :class:`TraceWriter` fed by the store: one call per accounted lookup batch."""

    def record(self, b) -> None:
        """Append a store ``Batch`` (``t``/``k`` per distinct row, ``inverse`` per id)."""
        ids = b.k.index_select(0, b.inverse).cpu()
        t = b.t.index_select(0, b.inverse).cpu()
        T = len(self.tables)
        t0 = int(t[0]) if t.numel() else 0
        if t.numel() == 0 or bool((t == t0).all()):
            lens = np.zeros(T, dtype=np.int64)
            lens[t0] = t.numel()
            self.add_flat(ids.numpy().copy(), lens)
            return
        lens = torch.bincount(t, minlength=T).numpy().astype(np.int64)
        self.add_flat(ids.numpy().copy(), lens, t.numpy().astype(np.int16))  # lookup order kept


@dataclass(frozen=True)
class Trace:
    """A loaded trace: all ids in memory (the simulator replays whole arrays).

    Attributes:
        path: the directory.
        tables: table names.
        ids: int64 ``[accesses]``, batch after batch; inside a batch table after table,
            or in lookup order when ``tabs`` is set.
        lens: int64 ``[batches, tables]``.
        updates: each batch was followed by an update of its ids.
        tabs: int16 ``[accesses]``, the table of each id (None: table after table).
    """

    path: Path
    tables: tuple[str, ...]
    ids: np.ndarray
    lens: np.ndarray
    updates: bool
    tabs: np.ndarray | None = None

    @property
    def num_batches(self) -> int:
        return int(self.lens.shape[0])

    @property
    def accesses(self) -> int:
        return int(self.ids.size)

    @property
    def batch_offsets(self) -> np.ndarray:
        """int64 ``[batches + 1]``: batch ``i`` is ``ids[off[i]:off[i+1]]``."""
        return np.concatenate(([0], np.cumsum(self.lens.sum(1))))

    def table_of_ids(self) -> np.ndarray:
        """int64 ``[accesses]``: the table of each id."""
        if self.tabs is not None:
            return self.tabs.astype(np.int64)
        T = len(self.tables)
        return np.repeat(np.tile(np.arange(T, dtype=np.int64), self.num_batches), self.lens.reshape(-1))

    def batches(self) -> Iterator[list[np.ndarray]]:
        """Per batch, one id array per table."""
        T = len(self.tables)
        if self.tabs is not None:
            off = self.batch_offsets
            for i in range(self.num_batches):
                ids, tab = self.ids[off[i]:off[i + 1]], self.tabs[off[i]:off[i + 1]]
                yield [ids[tab == t] for t in range(T)]
            return
        off = np.concatenate(([0], np.cumsum(self.lens.reshape(-1))))
        for i in range(self.num_batches):
            yield [self.ids[off[i * T + t]:off[i * T + t + 1]] for t in range(T)]


def bad_trace(path, reason: str) -> TraceFormatError:
    return TraceFormatError(path, reason)


def _read_manifest(path: Path) -> dict:
    mf = path / MANIFEST
    if not path.is_dir():
        raise bad_trace(path, "not a hiermem trace (expected a directory with manifest.json)")
    try:
        doc = json.loads(mf.read_text())
    except FileNotFoundError:
        raise bad_trace(mf, "missing: not a hiermem trace") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_trace(mf, f"unreadable trace manifest: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise bad_trace(mf, f"not a hiermem trace manifest (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != VERSION:
        raise bad_trace(mf, f"trace format version {doc.get('version')!r}; this hiermem reads version {VERSION}")
    tables, chunks = doc.get("tables"), doc.get("chunks")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, str) for t in tables) \
            or not isinstance(chunks, list) or not isinstance(doc.get("updates"), bool):
        raise bad_trace(mf, "corrupt manifest: needs tables (names), chunks (list) and updates (bool)")
    for c in chunks:
        if not isinstance(c, dict) or not all(isinstance(c.get(k), int) for k in ("batches", "accesses")) \
                or not all(isinstance(c.get(k), str) and "/" not in c[k] for k in ("ids", "lens")):
            raise bad_trace(mf, f"corrupt chunk entry {c!r}")
    return doc


def _npy_header(f) -> tuple[tuple, np.dtype]:
    """The shape and dtype of the ``.npy`` open in ``f`` (left at the start of its data)."""
    major, _ = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dt = read(f)
    return shape, dt


@contextmanager
def _chunk_errors(path: Path):
    """A chunk file missing or unreadable (numpy parses the header) as TraceFormatError."""
    try:
        yield
    except FileNotFoundError:
        raise bad_trace(path, "trace chunk missing") from None
    except (OSError, ValueError, EOFError, SyntaxError, tokenize.TokenError) as e:
        raise bad_trace(path, f"corrupt trace chunk: {e}") from e


def _check_npy_size(path: Path) -> None:
    """Refuse a .npy whose header claims more data than the file holds (np.load would
    first try to allocate it: a corrupt shape of 10**12 ids is a MemoryError)."""
    with open(path, "rb") as f:
        shape, dt = _npy_header(f)
        need = int(np.prod(shape, dtype=object)) * dt.itemsize
        if need > os.fstat(f.fileno()).st_size - f.tell():
            raise bad_trace(path, f"corrupt trace chunk: its header claims {need} bytes the file does not hold")


def _read_ids_into(path: Path, out: np.ndarray) -> None:
    """Read a chunk's ids (an int64 ``.npy`` of exactly ``out.size`` values) straight into
    ``out`` (a slice of the trace's one array: no per-chunk array, no concatenation)."""
    with _chunk_errors(path), open(path, "rb") as f:
        shape, dt = _npy_header(f)
        if dt != np.dtype(np.int64) or len(shape) != 1:
            raise bad_trace(path, f"trace chunk must be int64 with 1 dims, got {dt} {shape}")
        if shape[0] != out.size:
            raise bad_trace(path, "chunk disagrees with the manifest (batch or id counts)")
        got = f.readinto(memoryview(out).cast("B")) if out.size else 0
        if got != out.nbytes:
            raise bad_trace(path, f"corrupt trace chunk: {out.nbytes} bytes of ids expected, the file holds {got}")


def _load_npy(path: Path, dtype, ndim: int) -> np.ndarray:
    with _chunk_errors(path):
        _check_npy_size(path)
        a = np.load(path, allow_pickle=False)
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim:
        raise bad_trace(path, f"trace chunk must be {np.dtype(dtype)} with {ndim} dims, got "
                         f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
    return a


def load_trace(path: str | os.PathLike) -> Trace:
    """Load a trace directory written by :class:`TraceWriter` (or an importer).

    Raises:
        TraceFormatError: not a trace, unknown version, a missing or corrupt chunk, or
            chunks that disagree with the manifest (the message names the file).
    """
    path = Path(path)
    doc = _read_manifest(path)
    T = len(doc["tables"])
    lens, tabs = [], []
    if any(c["accesses"] < 0 for c in doc["chunks"]):
        raise bad_trace(path / MANIFEST, "corrupt manifest: a chunk of fewer than 0 accesses")
    all_ids = np.empty(sum(c["accesses"] for c in doc["chunks"]), dtype=np.int64)
    at = 0
    for c in doc["chunks"]:
        n = _load_npy(path / c["lens"], np.int64, 2)
        if n.shape != (c["batches"], T) or int(n.sum()) != c["accesses"] or (n.size and int(n.min()) < 0):
            raise bad_trace(path / c["lens"], "chunk disagrees with the manifest (batch or id counts)")
        a = all_ids[at:at + c["accesses"]]
        _read_ids_into(path / c["ids"], a)
        if a.size and int(a.min()) < 0:
            raise bad_trace(path / c["ids"], "negative ids in trace chunk")
        at += a.size
        lens.append(n)
        tabs.append(_load_tabs(path, c, n, T))
    all_lens = np.concatenate(lens) if lens else np.zeros((0, T), dtype=np.int64)
    if all_ids.size != doc.get("accesses") or all_lens.shape[0] != doc.get("batches"):
        raise bad_trace(path / MANIFEST, "totals disagree with the chunks")
    all_tabs = None
    if any(x is not None for x in tabs):
        Tr = np.arange(T, dtype=np.int16)
        all_tabs = np.concatenate([x if x is not None else np.repeat(np.tile(Tr, n.shape[0]), n.reshape(-1))
                                   for x, n in zip(tabs, lens)])
    return Trace(path, tuple(doc["tables"]), all_ids, all_lens, doc["updates"], all_tabs)


def _load_tabs(path: Path, chunk: dict, lens: np.ndarray, T: int) -> np.ndarray | None:
    name = chunk.get("tabs")
    if name is None:
        return None
    if not isinstance(name, str) or "/" in name:
        raise bad_trace(path / MANIFEST, f"corrupt chunk entry {chunk!r}")
    tab = _load_npy(path / name, np.int16, 1)
    if tab.size != int(lens.sum()) or (tab.size and (int(tab.min()) < 0 or int(tab.max()) >= T)):
        raise bad_trace(path / name, "table indices disagree with the chunk's lens")
    ends = np.cumsum(lens.sum(1))[:-1]  # (in range now: bincount refuses negative values)
    per = [np.bincount(x, minlength=T) for x in np.split(tab.astype(np.int64), ends)] if tab.size else []
    if per and not np.array_equal(np.stack(per), lens):
        raise bad_trace(path / name, "table indices disagree with the chunk's lens")
    return tab


def write_trace(path: str | os.PathLike, tables: Sequence[str], ids: np.ndarray, lens: np.ndarray,
                updates: bool = True, source: str = "", chunk_accesses: int = 1 << 20) -> Path:
    """Write a whole in-memory stream (``ids`` flat, ``lens [batches, tables]``) as a trace."""
    with TraceWriter(path, tables, updates=updates, chunk_accesses=chunk_accesses, source=source) as w:
        w.add_stream(ids, lens)
    return Path(path)


def check_ids_array(ids) -> np.ndarray:
    """A 1-D integer id array as int64 (for the in-memory API)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.cpu().numpy()
    if not isinstance(ids, np.ndarray) or ids.dtype.kind not in "iu":
        raise InvalidTypeError("ids must be an integer numpy array or tensor")
    return ids.astype(np.int64, copy=False).reshape(-1)
