"""The slot record: a tier's per-slot control state packed in 32 bytes.

A row that changes tier reads the state of its old slot and writes that of its new one.
Kept in separate arrays (table, id, dirty bit, pins, policy key, victim-search mark),
that was about six cache misses per slot in a tier of a million slots, most of a swap's
cost next to the copy of the row itself.  Packed, it is one: each slot's state is one
32-byte record, records are 32-byte aligned, so no record straddles a cache line.

The kernels still see one 1-D array per field (numpy views with a 32-byte stride, which
numba types as layout ``"A"``): no kernel changed, and a field is still ``kt[s]``.

=====  ======  ========================================================
bytes  dtype   field
=====  ======  ========================================================
0-7    int64   ``keys_t``: the row's table, -1 for a free slot
8-15   int64   ``keys_k``: the row's id within its table
16-23  int64   ``key``: the eviction policy's key (smaller goes first)
24-27  int32   ``pins``: in-flight prefetches holding the row
28     bool    ``dirty``: changed since it was last written to LMDB
29     uint8   ``mark``: held by the batch being placed (victim search)
=====  ======  ========================================================
"""

from __future__ import annotations

import numpy as np

RECORD = 32  # bytes per slot
_ALIGN = 64  # a cache line: a record never straddles two


def slot_records(capacity: int) -> tuple[np.ndarray, ...]:
    """Views ``(keys_t, keys_k, key, pins, dirty, mark)`` over one zeroed buffer of
    records, ``keys_t`` -1 (every slot free).

    There are ``max(capacity, 2)`` records: numpy flags an array of at most one element
    contiguous, and numba would then compile every kernel a second time for a tier of
    one slot or none (a host tier of 0 rows is common).  A record past ``capacity`` is
    neither free (the tier's free stack never holds it) nor occupied (``keys_t`` -1), so
    no kernel ever sees it: slot loops skip free slots, and the rest go by the tier's
    capacity."""
    C = max(int(capacity), 2)
    raw = np.zeros(C * RECORD + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    buf = raw[off:off + C * RECORD]

    def view(dtype, at: int) -> np.ndarray:
        return np.ndarray((C,), dtype=dtype, buffer=buf, offset=at, strides=(RECORD,))

    kt = view(np.int64, 0)
    kt[:] = -1
    return kt, view(np.int64, 8), view(np.int64, 16), view(np.int32, 24), view(np.bool_, 28), view(np.uint8, 29)
