"""A vectorised open-addressing hash map from ``(table, id)`` keys to slots.

Every operation takes whole tensors of keys: each round of linear probing gathers a
window of buckets for every key still unresolved, so the Python loop runs once per probe
round (two or three at load <= 3/4), never once per key.  Values are slot numbers in
``[0, capacity)``, and the map keeps the reverse ``slot -> bucket`` array, so moving a row
to another slot or dropping it is a scatter, with no probing.

Memory is ``24 bytes x buckets`` (one ``(t, k, slot)`` row per bucket, so a probe touches
one cache line) plus 8 bytes per slot, with ``buckets = next_pow2(2 x capacity)``: it
grows with the tiers' capacity, never with the tables' ``num_rows``.

Not thread-safe: the owning store serialises access under its lock.
"""

from __future__ import annotations

import torch

from .hashing import _M1, mix64

EMPTY = -1
TOMBSTONE = -2


class SlotIndex:
    """Map up to ``capacity`` distinct ``(t, k)`` int64 pairs to distinct slots."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        nb = 16
        while nb < 2 * self.capacity:
            nb *= 2
        self.nbuckets = nb
        self.mask = nb - 1
        self.tab = torch.zeros((nb, 3), dtype=torch.int64, device=self.device)
        self.tab[:, 0] = EMPTY
        self.bt, self.bk, self.bv = self.tab[:, 0], self.tab[:, 1], self.tab[:, 2]  # views
        self.pos_of = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.size = 0
        self.tombstones = 0

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
