"""The key -> slot index of the control plane: compiled kernels over flat arrays.

One index maps every resident row ``(t, k)`` (table, id) to its *global* slot (device
slots ``[0, D)``, host slots ``[D, D + H)``).  Two layouts share one set of arrays, so
every kernel takes the same arguments whichever the store picked:

* **direct** (every table bounded and small enough): ``slot_of[offsets[t] + k]`` (int32)
  is the slot, one gather per probe; ``rev[slot]`` is the row's linear key.
* **hash** (unbounded tables, or huge bounded ones): open addressing with linear
  probing over ``tab [3 * nbuckets]`` (``t, k, slot`` per bucket, one cache line per
  probe), ``nbuckets = next_pow2(2 x capacity)``; ``rev[slot]`` is the row's bucket, so
  moving or dropping a row is a store, never a probe.  Memory grows with the tiers'
  capacity, never with the tables' ``num_rows``.

``meta`` (int64 ``[4]``) holds ``kind`` (0 direct, 1 hash), ``size`` (keys mapped),
``tombstones`` and the bucket ``mask``.  Not thread-safe: the owning store's lock guards it.
"""

from __future__ import annotations

import numpy as np
import torch
from numba.core import types

from .jit import DISABLED, is_warm, kernel, prefetch, tiny
from .names import DIRECT, HASH, IX_KIND as _KIND, IX_MASK as _MASK, IX_SIZE as _SIZE, IX_TOMB as _TOMB  # noqa: F401

_AHEAD = 16  # keys ahead whose entry a batch lookup prefetches
EMPTY = -1
TOMBSTONE = -2

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@tiny
def home(t, k, mask):
    """Home bucket of ``(t, k)``: splitmix64 of ``k ^ t * M1``, masked."""
    z = np.uint64(k) ^ (np.uint64(t) * _M1)
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    z = z ^ (z >> np.uint64(31))
    return np.int64(z & np.uint64(mask))


@tiny
def find1(meta, offsets, slot_of, tab, t, k):
    """Slot of ``(t, k)``, or -1."""
    if meta[_KIND] == DIRECT:
        return np.int64(slot_of[offsets[t] + k])
    mask = meta[_MASK]
    p = home(t, k, mask)
    while True:
        bt = tab[3 * p]
        if bt == EMPTY:
            return np.int64(-1)
        if bt == t and tab[3 * p + 1] == k:
            return tab[3 * p + 2]
        p = (p + 1) & mask


@tiny
def _put_bucket(meta, tab, rev, t, k, v):
    mask = meta[_MASK]
    p = home(t, k, mask)
    while tab[3 * p] >= 0:
        p = (p + 1) & mask
    if tab[3 * p] == TOMBSTONE:
        meta[_TOMB] -= 1
    tab[3 * p] = t
    tab[3 * p + 1] = k
    tab[3 * p + 2] = v
    rev[v] = p


@kernel
def rehash(meta, tab, rev):
    """Rebuild the hash table in place without tombstones (same keys, same slots)."""
    nb = tab.size // 3
    live = np.int64(0)
    for p in range(nb):
        if tab[3 * p] >= 0:
            live += 1
    keep = np.empty((live, 3), dtype=np.int64)
    j = np.int64(0)
    for p in range(nb):
        if tab[3 * p] >= 0:
            keep[j, 0] = tab[3 * p]
            keep[j, 1] = tab[3 * p + 1]
            keep[j, 2] = tab[3 * p + 2]
            j += 1
    for p in range(nb):
        tab[3 * p] = EMPTY
    meta[_TOMB] = 0
    for j in range(live):
        _put_bucket(meta, tab, rev, keep[j, 0], keep[j, 1], keep[j, 2])


if not DISABLED and not is_warm():  # before any leaf reaches it through insert1 (see hiermem.core.victims)
    rehash.compile((types.Array(types.int64, 1, "C"),) * 3)


@tiny
def insert1(meta, offsets, slot_of, rev, tab, t, k, v):
    """Map ``(t, k)`` (known absent) to slot ``v``."""
    if meta[_KIND] == DIRECT:
        lin = offsets[t] + k
        slot_of[lin] = v
        rev[v] = lin
    else:
        if 4 * (meta[_SIZE] + meta[_TOMB] + 1) > 3 * (tab.size // 3):
            rehash(meta, tab, rev)
        _put_bucket(meta, tab, rev, t, k, v)
    meta[_SIZE] += 1


@tiny
def remove1(meta, slot_of, rev, tab, v):
    """Drop the key mapped to slot ``v``."""
    if meta[_KIND] == DIRECT:
        slot_of[rev[v]] = -1
    else:
        tab[3 * rev[v]] = TOMBSTONE
        meta[_TOMB] += 1
    rev[v] = -1
    meta[_SIZE] -= 1


@tiny
def repoint1(meta, slot_of, rev, tab, entry, v):
    """Point index entry ``entry`` (a ``rev`` value taken from a moved slot) at slot ``v``."""
    if meta[_KIND] == DIRECT:
        slot_of[entry] = v
    else:
        tab[3 * entry + 2] = v
    rev[v] = entry


@kernel
def find(meta, offsets, slot_of, tab, t, k, out):
    """``out[i]`` = slot of ``(t[i], k[i])`` or -1.  ``t, k, out``: int64 ``[n]``.

    The batch form of :func:`find1`, written out: the layout is decided once, and the
    loop body touches only plain arrays (no call per id)."""
    if meta[_KIND] == DIRECT:
        n = k.size
        for i in range(n):
            if i + _AHEAD < n:  # a batch's rows are spread over the table: their entries are not cached
                prefetch(slot_of, offsets[t[i + _AHEAD]] + k[i + _AHEAD])
            out[i] = slot_of[offsets[t[i]] + k[i]]
        return
    mask = np.uint64(meta[_MASK])
    for i in range(k.size):
        ti, ki = t[i], k[i]
        z = np.uint64(ki) ^ (np.uint64(ti) * _M1)
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
        p = np.int64(z & mask)
        while True:
            bt = tab[3 * p]
            if bt == EMPTY:
                out[i] = -1
                break
            if bt == ti and tab[3 * p + 1] == ki:
                out[i] = tab[3 * p + 2]
                break
            p = (p + 1) & np.int64(mask)


@kernel
def insert(meta, offsets, slot_of, rev, tab, t, k, v):
    """Map distinct absent keys ``(t[i], k[i])`` to free slots ``v[i]`` (int64 ``[n]``)."""
    for i in range(k.size):
        insert1(meta, offsets, slot_of, rev, tab, t[i], k[i], v[i])


@kernel
def remove(meta, slot_of, rev, tab, v):
    """Drop the keys mapped to slots ``v`` (int64 ``[n]``, each mapped)."""
    for i in range(v.size):
        remove1(meta, slot_of, rev, tab, v[i])


@kernel
def move(meta, slot_of, rev, tab, src, dst):
    """Keys mapped to ``src[i]`` now map to ``dst[i]``, all pairs at once (a ``dst`` may be
    another pair's ``src``; each ``dst`` is free after the move).  int64 ``[n]``."""
    entry = np.empty(src.size, dtype=np.int64)
    for i in range(src.size):
        entry[i] = rev[src[i]]
        rev[src[i]] = -1
    for i in range(src.size):
        repoint1(meta, slot_of, rev, tab, entry[i], dst[i])


@kernel
def _items(meta, offsets, slot_of, rev, tab):
    n = meta[_SIZE]
    t = np.empty(n, dtype=np.int64)
    k = np.empty(n, dtype=np.int64)
    v = np.empty(n, dtype=np.int64)
    j = np.int64(0)
    for s in range(rev.size):
        e = rev[s]
        if e < 0:
            continue
        if meta[_KIND] == DIRECT:
            ti = np.searchsorted(offsets, e, side="right") - 1
            t[j] = ti
            k[j] = e - offsets[ti]
        else:
            t[j] = tab[3 * e]
            k[j] = tab[3 * e + 1]
        v[j] = s
        j += 1
    return t, k, v


# a direct map is used while it takes at most this much, or no more than the hash map
DIRECT_INDEX_BYTES = 64 << 20


def _nbuckets(capacity: int) -> int:
    nb = 16
    while nb < 2 * capacity:
        nb *= 2
    return nb


def as_array(x, dtype=np.int64) -> np.ndarray:
    """A contiguous numpy array of ``dtype`` for a kernel: a view of a CPU tensor or array
    when it already is one, else a copy (device tensors come to the CPU)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=dtype)


class KeyIndex:
    """Map up to ``capacity`` distinct ``(t, k)`` int64 pairs to distinct slots.

    Args:
        capacity: slots (device + host).
        sizes: rows of each table (None: unbounded); picks the layout (:func:`make_index`).
        direct: force the layout (None: pick by memory).
    """

    def __init__(self, capacity: int, sizes: list[int | None], direct: bool | None = None):
        self.capacity = int(capacity)
        if direct is None:
            direct = self.direct_fits(self.capacity, sizes)
        self.meta = np.zeros(4, dtype=np.int64)
        self.rev = np.full(self.capacity, -1, dtype=np.int64)
        if direct:
            self.meta[_KIND] = DIRECT
            self.offsets = np.array([0] + list(np.cumsum(sizes[:-1])), dtype=np.int64)
            self.slot_of = np.full(int(sum(sizes)), -1, dtype=np.int32)
            self.tab = np.zeros(3, dtype=np.int64)
        else:
            nb = _nbuckets(self.capacity)
            self.meta[_KIND], self.meta[_MASK] = HASH, nb - 1
            self.offsets = np.zeros(max(1, len(sizes)), dtype=np.int64)
            self.slot_of = np.zeros(1, dtype=np.int32)
            self.tab = np.full(3 * nb, EMPTY, dtype=np.int64)

    @staticmethod
    def direct_fits(capacity: int, sizes: list[int | None]) -> bool:
        """A direct map when every table is bounded and one int32 per row costs at most
        ``max(DIRECT_INDEX_BYTES, the hash map's bytes)``."""
        if capacity >= 2**31 or any(n is None for n in sizes):
            return False
        return 4 * sum(sizes) <= max(DIRECT_INDEX_BYTES, KeyIndex.hash_bytes(capacity))

    @staticmethod
    def hash_bytes(capacity: int) -> int:
        return 3 * 8 * _nbuckets(capacity) + 8 * capacity

    @property
    def direct(self) -> bool:
        return int(self.meta[_KIND]) == DIRECT

    @property
    def size(self) -> int:
        return int(self.meta[_SIZE])

    @property
    def arrays(self) -> tuple:
        """``(meta, offsets, slot_of, rev, tab)``: what the kernels take."""
        return self.meta, self.offsets, self.slot_of, self.rev, self.tab

    def find(self, t, k) -> torch.Tensor:
        """Slot of each key ``(t[i], k[i])`` (int64, CPU), or -1 where absent."""
        t, k = as_array(t), as_array(k)
        out = np.empty(k.size, dtype=np.int64)
        find(self.meta, self.offsets, self.slot_of, self.tab, t, k, out)
        return torch.from_numpy(out)

    def insert(self, t, k, slots) -> None:
        """Insert distinct keys known to be absent, mapping them to free ``slots``."""
        t, k, v = as_array(t), as_array(k), as_array(slots)
        assert self.size + k.size <= self.capacity, "KeyIndex over capacity"
        insert(self.meta, self.offsets, self.slot_of, self.rev, self.tab, t, k, v)

    def remove_slots(self, slots) -> None:
        """Drop the keys mapped to ``slots`` (each mapped)."""
        v = as_array(slots)
        assert bool((self.rev[v] >= 0).all()), "KeyIndex.remove_slots of an unmapped slot"
        remove(self.meta, self.slot_of, self.rev, self.tab, v)

    def move_slots(self, src, dst) -> None:
        """Keys mapped to ``src[i]`` now map to ``dst[i]``, all pairs at once."""
        s, d = as_array(src), as_array(dst)
        assert bool((self.rev[s] >= 0).all()), "KeyIndex.move_slots of an unmapped slot"
        move(self.meta, self.slot_of, self.rev, self.tab, s, d)

    def items(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(t, k, slot)`` of every mapped key, in slot order."""
        return tuple(torch.from_numpy(x) for x in _items(*self.arrays))

    def nbytes(self) -> int:
        return (self.slot_of.nbytes if self.direct else self.tab.nbytes) + self.rev.nbytes


def make_index(capacity: int, sizes: list[int | None]) -> KeyIndex:
    """The store's key -> slot map (layout picked by :meth:`KeyIndex.direct_fits`)."""
    return KeyIndex(capacity, sizes)
