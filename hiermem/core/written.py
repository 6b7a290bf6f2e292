"""The simulator's backing of a placement: LMDB as a written-rows bitmap, records of zero width.

Between :func:`~hiermem.core.plan.decide` and :func:`~hiermem.core.plan.commit` the
store reads the plan's disk rows from LMDB and writes its dirty victims down
(:class:`hiermem.store.residency.Residency`); a simulation does the same with one bit per
row ("has been written down", ``written``, uint8 per dense row) and counts the bytes a
record of ``row_bytes`` would move.  One implementation, inlined into the compiled replay
(:mod:`hiermem.core.replay`) and wrapped as kernels for the simulator's per-batch
placement (:class:`hiermem.store.placing.WrittenRows`).  Rows are dense numbers: index
key ``(t, k)`` is dense row ``row_base[t] + k``.
"""

from __future__ import annotations

from .jit import kernel, tiny
from .names import (DISK, FOUND, IO_BYTES_DEVICE_TO_HOST, IO_BYTES_DISK_TO_HOST, IO_BYTES_HOST_TO_DEVICE,
                    IO_BYTES_HOST_TO_DISK, N_DISK, N_DN, N_UP, N_WB, NB, WB)


@tiny
def fetch_(ws, res, bt, bk, row_base, written, io, row_bytes):
    """The plan's disk rows: ``ws[FOUND][j]`` = whether disk row ``j`` was written down;
    the bytes read from LMDB counted."""
    disk, found = ws[DISK], ws[FOUND]
    for j in range(res[N_DISK]):
        p = disk[j]
        w = written[row_base[bt[p]] + bk[p]]
        found[j] = w
        io[IO_BYTES_DISK_TO_HOST] += w * row_bytes


@tiny
def write_back_(ws, res, dkt, dkk, hkt, hkk, D, Hb, row_base, written, io, row_bytes):
    """The plan's dirty victims (global slots ``ws[WB]``) are written down."""
    wb = ws[WB]
    for j in range(res[N_WB]):
        s = wb[j]
        if s >= D:
            s -= Hb
            written[row_base[hkt[s]] + hkk[s]] = 1
        else:
            written[row_base[dkt[s]] + dkk[s]] = 1
    io[IO_BYTES_HOST_TO_DISK] += res[N_WB] * row_bytes


@tiny
def moved_(res, io, row_bytes):
    """The bytes a committed plan copies between the device and the host."""
    io[IO_BYTES_DEVICE_TO_HOST] += res[N_DN] * row_bytes
    io[IO_BYTES_HOST_TO_DEVICE] += (res[N_UP] + res[NB]) * row_bytes


@kernel
def fetch(ws, res, bt, bk, row_base, written, io, row_bytes):
    """:func:`fetch_` (called between ``decide`` and ``commit``)."""
    fetch_(ws, res, bt, bk, row_base, written, io, row_bytes)


@kernel
def write_back(ws, res, dkt, dkk, hkt, hkk, D, Hb, row_base, written, io, row_bytes):
    """:func:`write_back_` (called between ``decide`` and ``commit``)."""
    write_back_(ws, res, dkt, dkk, hkt, hkk, D, Hb, row_base, written, io, row_bytes)


@kernel
def moved(res, io, row_bytes):
    """:func:`moved_` (called after ``commit``)."""
    moved_(res, io, row_bytes)


@kernel
def row_hashes(bt, bk, row_base, row_hash, out):
    """``out[i]``: the hash of row ``(bt[i], bk[i])``, looked up in ``row_hash`` (int64 per
    dense row: the store's hash of the row's table and id, :func:`hiermem.core.sketch.rowhash`)."""
    for i in range(bk.size):
        out[i] = row_hash[row_base[bt[i]] + bk[i]]
