"""Row hashes and a count-min sketch over them: one implementation for W-TinyLFU's
frequency sketch (:mod:`hiermem.core.queues`) and the admission filter's
(:mod:`hiermem.core.admission`).

A row is known by a 64-bit hash of ``(table, id)`` (:func:`rowhash`, splitmix64): the
store hashes its rows' ids (:func:`row_hashes`), the simulator looks up the same hashes
of the rows it numbers densely (:func:`hiermem.core.written.row_hashes`), so a sketch's
collisions are the same in both.

The sketch is ``ROWS`` (4) rows of ``w`` int64 counts (``w`` a power of two) at
``a[off:off + ROWS * w]``; row ``r`` counts hash ``h`` at ``mix(h + r) mod w``.  The
estimate is the least of the four counts; an increment raises only the counts at that
least value ("minimal increment", conservative update), and :func:`halve` is TinyLFU's
reset (every count halved, so old frequencies fade).
"""

from __future__ import annotations

import numpy as np

from .jit import helper, kernel, tiny

ROWS = 4
_U = np.uint64
_K1 = _U(0xBF58476D1CE4E5B9)
_K2 = _U(0x94D049BB133111EB)
_GOLD = _U(0x9E3779B97F4A7C15)


@tiny
def mix(x):
    """splitmix64's finaliser (uint64)."""
    z = _U(x) + _GOLD
    z = (z ^ (z >> _U(30))) * _K1
    z = (z ^ (z >> _U(27))) * _K2
    return z ^ (z >> _U(31))


@tiny
def rowhash(t, k):
    """A nonzero int64 hash of row ``(t, k)`` (splitmix64)."""
    return np.int64(mix(np.int64(mix(t)) ^ k) | _U(1))


@kernel
def row_hashes(bt, bk, out):
    """``out[i] = rowhash(bt[i], bk[i])`` (int64 ``[n]`` each): the store's row hashes."""
    for i in range(bk.size):
        out[i] = rowhash(bt[i], bk[i])


def width(capacity: int, per_slot: int) -> int:
    """Counts per sketch row for a tier of ``capacity`` slots: the power of two at least
    ``per_slot`` counts a slot (and 64)."""
    w = 64
    while w < per_slot * max(1, int(capacity)):
        w *= 2
    return w


@tiny
def _idx(off, w, h, r):
    return off + r * w + np.int64(mix(h + r) & _U(w - 1))


@helper
def estimate(a, off, w, h):
    """The sketch's count of hash ``h``: the least of its ``ROWS`` counts."""
    m = a[_idx(off, w, h, 0)]
    for r in range(1, ROWS):
        m = min(m, a[_idx(off, w, h, r)])
    return m


@helper
def increment(a, off, w, h):
    """Count hash ``h`` once: only the counts at its least value grow."""
    m = estimate(a, off, w, h)
    for r in range(ROWS):
        i = _idx(off, w, h, r)
        if a[i] == m:
            a[i] = m + 1


@helper
def halve(a, off, w):
    """Every count halved (TinyLFU's reset)."""
    for i in range(off, off + ROWS * w):
        a[i] >>= 1
