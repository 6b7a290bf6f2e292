"""References for one tier of ``capacity`` rows, per access: Belady's MIN and LRU curves.

* :func:`belady_misses`: the optimal offline demand-paging miss count (the requested row
  must be resident to be used; on a miss the resident row whose next use is farthest is
  evicted), over the full access stream.  It bounds the device misses of every policy
  and prefetch depth whenever each batch's distinct rows fit in the device tier: such
  a batch-granular run, replayed access by access, is a valid demand-paging schedule
  with the same misses, and prefetching never beats demand paging.  (When a batch
  overflows the device, the batch counters count duplicates served from the host as
  device hits, and the per-access bound need not hold.)
* :func:`lru_stack_distances` / :func:`lru_mrc`: Mattson's stack distances in one pass
  (a Fenwick tree over "last occurrence" markers), so the LRU miss count of *every*
  capacity comes from one histogram.

Both are sequential algorithms over next-use/previous-use arrays computed with numpy
sorts.  The kernels are compiled with numba when it is installed (``pip install
hiermem[sim]``); without it the same code runs as plain Python (exact, ~100x slower).
"""

from __future__ import annotations

import heapq
import importlib.util
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError

HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_COMPILED: dict = {}


def _kernel(fn):
    """``fn`` compiled by numba on first use (imported lazily: the CLI starts fast), or
    ``fn`` itself, with a warning, when numba is not installed."""
    k = _COMPILED.get(fn)
    if k is None:
        if HAVE_NUMBA:
            import numba

            k = numba.njit(cache=True, nogil=True)(fn)
        else:  # pragma: no cover
            warnings.warn("numba is not installed: hiermem.sim.bounds runs as plain Python "
                          "(pip install 'hiermem[sim]')", RuntimeWarning, stacklevel=3)
            k = fn
        _COMPILED[fn] = k
    return k


def dense_ids(ids: np.ndarray) -> np.ndarray:
    """Ids renumbered ``0..D-1`` (sorted order), as int64."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    from .engine import _rank  # a presence table when ids are dense enough, else np.unique

    lo = int(ids.min())
    return _rank(ids.astype(np.int64) - lo if lo else ids.astype(np.int64, copy=False))[0]


def next_use(dense: np.ndarray) -> np.ndarray:
    """``nxt[i]``: position of the next access to ``dense[i]``, or ``n + dense[i]`` if none
    (distinct "never" times, farther than any real one)."""
    n = dense.size
    order = np.argsort(dense, kind="stable")
    nxt = np.empty(n, dtype=np.int64)
    same = dense[order[1:]] == dense[order[:-1]]
    nxt[order[:-1]] = np.where(same, order[1:], n + dense[order[:-1]])
    if n:
        nxt[order[-1]] = n + dense[order[-1]]
    return nxt


def prev_use(dense: np.ndarray) -> np.ndarray:
    """``prev[i]``: position of the previous access to ``dense[i]``, or -1."""
    n = dense.size
    order = np.argsort(dense, kind="stable")
    prev = np.full(n, -1, dtype=np.int64)
    same = dense[order[1:]] == dense[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def _stack_distances(dense, num_rows):  # pragma: no cover - compiled
    n = dense.size
    tree = np.zeros(n + 1, dtype=np.int64)  # Fenwick tree over positions: 1 = latest access of its row
    last = np.full(num_rows, -1, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        p = last[dense[i]]
        last[dense[i]] = i
        if p < 0:
            out[i] = -1
        else:
            s = 0
            j = i  # prefix sum over positions < i
            while j > 0:
                s += tree[j]
                j -= j & -j
            j = p + 1  # minus the prefix over positions <= p
            while j > 0:
                s -= tree[j]
                j -= j & -j
            out[i] = s
            j = p + 1
            while j <= n:
                tree[j] -= 1
                j += j & -j
        j = i + 1
        while j <= n:
            tree[j] += 1
            j += j & -j
    return out


def lru_stack_distances(ids: np.ndarray) -> np.ndarray:
    """Per access, the number of distinct other rows used since its previous access
    (-1 for a first access).  An access hits an LRU cache of ``c`` rows iff ``0 <= d < c``."""
    d = dense_ids(ids)
    return _kernel(_stack_distances)(d, int(d.max()) + 1 if d.size else 0)


@dataclass(frozen=True)
class MissRatioCurve:
    """LRU misses of every capacity ``1..distinct`` from one pass.

    Attributes:
        accesses: accesses in the stream; distinct: rows in it (compulsory misses).
        hist: ``hist[d]`` accesses with stack distance ``d``.
    """

    accesses: int
    distinct: int
    hist: np.ndarray

    def misses(self, capacity) -> np.ndarray | int:
        """LRU misses at ``capacity`` (an int or an array of ints >= 1)."""
        c = np.asarray(capacity, dtype=np.int64)
        if bool((c < 1).any()):
            raise InvalidArgumentError("capacities must be >= 1")
        cum = np.concatenate(([0], np.cumsum(self.hist)))
        hits = cum[np.minimum(c, self.hist.size)]
        out = self.accesses - hits
        return int(out) if out.ndim == 0 else out

    def miss_ratio(self, capacity) -> np.ndarray | float:
        m = self.misses(capacity)
        return m / self.accesses if self.accesses else m * 0.0


def lru_mrc(ids: np.ndarray) -> MissRatioCurve:
    """The exact per-access LRU miss-ratio curve of a stream (all capacities at once)."""
    d = lru_stack_distances(ids)
    reuse = d[d >= 0]
    hist = np.bincount(reuse) if reuse.size else np.zeros(0, dtype=np.int64)
    return MissRatioCurve(int(d.size), int((d < 0).sum()), hist)


def _belady(dense, nxt, capacity, num_rows):  # pragma: no cover - compiled
    n = dense.size
    resident = np.zeros(num_rows, dtype=np.bool_)
    cur = np.zeros(num_rows, dtype=np.int64)  # next use of each resident row
    heap = [np.int64(0)]  # max-heap of next uses (negated); entries go stale lazily
    heap.pop()
    size = 0
    misses = 0
    for i in range(n):
        x = dense[i]
        if not resident[x]:
            misses += 1
            if size == capacity:
                while True:
                    t = -heapq.heappop(heap)
                    y = dense[t] if t < n else t - n
                    if resident[y] and cur[y] == t:
                        resident[y] = False
                        size -= 1
                        break
            resident[x] = True
            size += 1
        cur[x] = nxt[i]
        heapq.heappush(heap, -nxt[i])
    return misses


def belady_misses(ids: np.ndarray, capacity: int) -> int:
    """Belady's MIN miss count for one tier of ``capacity`` rows (demand paging)."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise InvalidArgumentError(f"capacity must be an int >= 1, got {capacity!r}")
    d = dense_ids(ids)
    if d.size == 0:
        return 0
    return int(_kernel(_belady)(d, next_use(d), int(capacity), int(d.max()) + 1))
