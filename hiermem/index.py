"""The store's map from ``(table, id)`` keys to slots, in two interchangeable forms.

:class:`DirectIndex` (every table bounded, and small enough) is one int32 slot per row
of the linearised id space, so a lookup is one gather.  Otherwise :class:`SlotIndex`,
a vectorised open-addressing hash map:

Every operation takes whole tensors of keys: each round of linear probing gathers a
window of buckets for every key still unresolved, so the Python loop runs once per probe
round (two or three at load <= 3/4), never once per key.  Values are slot numbers in
``[0, capacity)``, and the map keeps the reverse ``slot -> bucket`` array, so moving a row
to another slot or dropping it is a scatter, with no probing.

Memory is ``24 bytes x buckets`` (one ``(t, k, slot)`` row per bucket, so a probe touches
one cache line) plus 8 bytes per slot, with ``buckets = next_pow2(2 x capacity)``: it
grows with the tiers' capacity, never with the tables' ``num_rows``.

Neither is thread-safe: the owning store serialises access under its lock.
"""

from __future__ import annotations

import numpy as np
import torch

from .hashing import _M1, mix64

EMPTY = -1
TOMBSTONE = -2


class SlotIndex:
    """Map up to ``capacity`` distinct ``(t, k)`` int64 pairs to distinct slots."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        nb = self._nbuckets(self.capacity)
        self.nbuckets = nb
        self.mask = nb - 1
        self.tab = torch.zeros((nb, 3), dtype=torch.int64, device=self.device)
        self.tab[:, 0] = EMPTY
        self.bt, self.bk, self.bv = self.tab[:, 0], self.tab[:, 1], self.tab[:, 2]  # views
        self.pos_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.size = 0
        self.tombstones = 0

    @staticmethod
    def _nbuckets(capacity: int) -> int:
        nb = 16
        while nb < 2 * capacity:
            nb *= 2
        return nb

    @classmethod
    def bytes_for(cls, capacity: int) -> int:
        """What a map of ``capacity`` slots takes (see :meth:`nbytes`)."""
        return 3 * 8 * cls._nbuckets(capacity) + 8 * capacity

    def _home(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return mix64(k ^ (t * _M1)) & self.mask

    def _window(self, pos: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket positions ``[n, width]`` from ``pos`` on, and their rows ``[n, width, 3]``."""
        p = (pos.unsqueeze(1) + torch.arange(width, device=self.device)) & self.mask
        return p, self.tab.index_select(0, p.reshape(-1)).view(-1, width, 3)

    def find(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Slot of each key ``(t[i], k[i])``, or -1 where absent.

        Probes the home bucket, then windows of 16 buckets per round: a key lies before
        the first empty bucket of its probe sequence, so the first match-or-empty in the
        window decides it.
        """
        n = k.numel()
        out = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        if n == 0 or self.size == 0:
            return out
        active = torch.arange(n, device=self.device)
        pos = self._home(t, k)
        at, ak, width = t, k, 1
        while True:
            _, rows = self._window(pos, width)
            ct = rows[..., 0]
            match = (ct == at.unsqueeze(1)) & (rows[..., 1] == ak.unsqueeze(1))
            stop = match | (ct == EMPTY)
            first = stop.to(torch.uint8).argmax(1, keepdim=True)
            found = match.gather(1, first).squeeze(1)
            out[active[found]] = rows[..., 2].gather(1, first).squeeze(1)[found]
            go = ~stop.any(1)
            if not bool(go.any()):
                return out
            active, pos, at, ak = active[go], (pos[go] + width) & self.mask, at[go], ak[go]
            width = 16

    def insert(self, t: torch.Tensor, k: torch.Tensor, slots: torch.Tensor) -> None:
        """Insert distinct keys known to be absent, mapping them to free ``slots``."""
        n = k.numel()
        if n == 0:
            return
        assert self.size + n <= self.capacity, "SlotIndex over capacity"
        if self.size + self.tombstones + n > (self.nbuckets * 3) // 4:
            self._rebuild()
        self._insert(t, k, slots)
        self.size += n

    def _insert(self, t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        idx = torch.arange(k.numel(), device=self.device)
        pos = self._home(t, k)
        at, ak, av, width = t, k, v, 1
        while True:
            p, rows = self._window(pos, width)
            free = rows[..., 0] < 0
            has = free.any(1)
            first = free.to(torch.uint8).argmax(1, keepdim=True)
            cand = p.gather(1, first).squeeze(1)
            hidx, hpos = idx[has], cand[has]
            self.bv[hpos] = hidx  # claim: one writer per bucket wins
            won = torch.zeros_like(has)
            won[has] = self.bv.index_select(0, hpos) == hidx
            wpos = cand[won]
            self.tombstones -= int((self.bt.index_select(0, wpos) == TOMBSTONE).sum())
            wv = av[won]
            self.tab[wpos] = torch.stack((at[won], ak[won], wv), 1)
            self.pos_of[wv] = wpos
            go = ~won
            if not bool(go.any()):
                return
            # losers retry from the bucket they lost (now taken); full windows move on
            nxt = torch.where(has, cand, (pos + width) & self.mask)
            idx, pos, at, ak, av = idx[go], nxt[go], at[go], ak[go], av[go]
            width = 16

    def remove_slots(self, slots: torch.Tensor) -> None:
        """Drop the keys mapped to ``slots`` (each mapped)."""
        if slots.numel() == 0:
            return
        pos = self.pos_of.index_select(0, slots)
        assert bool((pos >= 0).all()), "SlotIndex.remove_slots of an unmapped slot"
        self.bt[pos] = TOMBSTONE
        self.pos_of[slots] = -1
        self.size -= slots.numel()
        self.tombstones += slots.numel()

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Keys mapped to ``src[i]`` now map to ``dst[i]``, all pairs at once.

        Each ``dst`` must be free after the move (a ``dst`` may be another pair's ``src``).
        """
        if src.numel() == 0:
            return
        pos = self.pos_of.index_select(0, src)
        assert bool((pos >= 0).all()), "SlotIndex.move_slots of an unmapped slot"
        self.pos_of[src] = -1
        self.bv[pos] = dst
        self.pos_of[dst] = pos

    def items(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        live = self.bt >= 0
        return self.bt[live], self.bk[live], self.bv[live]

    def _rebuild(self) -> None:
        t, k, v = self.items()
        self.bt.fill_(EMPTY)
        self.pos_of.fill_(-1)
        self.tombstones = 0
        self._insert(t, k, v)

    def nbytes(self) -> int:
        return 3 * 8 * self.nbuckets + 8 * self.capacity


class DirectIndex:
    """The same map as :class:`SlotIndex` for tables of known size: one slot entry per row.

    Keys are linearised (``offsets[t] + k``, every table bounded), so ``find`` is a single
    gather, where the hash map needs a hash, a probe window and a compare per round.
    Memory is ``4 bytes x total rows`` (int32 slots) plus 8 bytes per slot, so the store
    picks it only when that is small (see :func:`make_index`).
    """

    def __init__(self, capacity: int, offsets: torch.Tensor, total_rows: int, device: torch.device | str = "cpu"):
        assert capacity < 2**31, "DirectIndex slots are int32"
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.offsets = offsets.to(self.device, torch.int64)
        self.slot_of = torch.full((int(total_rows),), -1, dtype=torch.int32, device=self.device)
        self.key_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.size = 0

    def _lin(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.offsets.index_select(0, t) + k

    def find(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Slot of each key ``(t[i], k[i])``, or -1 where absent."""
        if k.numel() == 0:
            return torch.full((0,), -1, dtype=torch.int64, device=self.device)
        return self.slot_of.index_select(0, self._lin(t, k)).to(torch.int64)

    def insert(self, t: torch.Tensor, k: torch.Tensor, slots: torch.Tensor) -> None:
        """Insert distinct keys known to be absent, mapping them to free ``slots``."""
        n = k.numel()
        if n == 0:
            return
        assert self.size + n <= self.capacity, "DirectIndex over capacity"
        lin = self._lin(t, k)
        self.slot_of[lin] = slots.to(torch.int32)
        self.key_of[slots] = lin
        self.size += n

    def remove_slots(self, slots: torch.Tensor) -> None:
        """Drop the keys mapped to ``slots`` (each mapped)."""
        if slots.numel() == 0:
            return
        lin = self.key_of.index_select(0, slots)
        assert bool((lin >= 0).all()), "DirectIndex.remove_slots of an unmapped slot"
        self.slot_of[lin] = -1
        self.key_of[slots] = -1
        self.size -= slots.numel()

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Keys mapped to ``src[i]`` now map to ``dst[i]``, all pairs at once."""
        if src.numel() == 0:
            return
        lin = self.key_of.index_select(0, src)
        assert bool((lin >= 0).all()), "DirectIndex.move_slots of an unmapped slot"
        self.key_of[src] = -1
        self.slot_of[lin] = dst.to(torch.int32)
        self.key_of[dst] = lin

    def items(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = (self.key_of >= 0).nonzero().squeeze(1)
        lin = self.key_of.index_select(0, slots)
        t = torch.searchsorted(self.offsets, lin, right=True) - 1
        return t, lin - self.offsets.index_select(0, t), slots

    def nbytes(self) -> int:
        return 4 * self.slot_of.numel() + 8 * self.capacity


# a direct map is used while it takes at most this much, or no more than the hash map
DIRECT_INDEX_BYTES = 64 << 20


def make_index(capacity: int, sizes: list[int | None], device: torch.device | str = "cpu"):
    """The store's key -> slot map: a :class:`DirectIndex` when every table is bounded
    and one int32 per row costs at most ``max(DIRECT_INDEX_BYTES, the hash map's bytes)``,
    else a :class:`SlotIndex`."""
    if capacity < 2**31 and all(n is not None for n in sizes):
        total = sum(sizes)
        hash_bytes = SlotIndex.bytes_for(capacity)
        if 4 * total <= max(DIRECT_INDEX_BYTES, hash_bytes):
            offsets = torch.tensor([0] + list(np.cumsum(sizes[:-1])), dtype=torch.int64)
            return DirectIndex(capacity, offsets, total, device)
    return SlotIndex(capacity, device)
