"""A vectorised open-addressing hash map from ``(table, id)`` keys to slots.

Every operation takes whole tensors of keys: each round of linear probing gathers a window of
buckets for every key still unresolved, so the Python loop runs once per probe round
(two or three at load <= 3/4), never once per key.  Memory is
``24 bytes x buckets`` (one ``(t, k, value)`` row per bucket, so a probe touches one
cache line) with ``buckets = next_pow2(2 x capacity)``: it grows with the
tier's capacity, never with the tables' ``num_rows``.

Not thread-safe: the owning store serialises access under its lock.
"""

from __future__ import annotations

import torch

from .hashing import _M1, mix64

EMPTY = -1
TOMBSTONE = -2


class KeyIndex:
    """Map up to ``capacity`` distinct ``(t, k)`` int64 pairs to int64 values."""

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
        self.size = 0
        self.tombstones = 0

    def _home(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return mix64(k ^ (t * _M1)) & self.mask

    def _window(self, pos: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket positions ``[n, width]`` from ``pos`` on, and their rows ``[n, width, 3]``."""
        p = (pos.unsqueeze(1) + torch.arange(width, device=self.device)) & self.mask
        return p, self.tab.index_select(0, p.reshape(-1)).view(-1, width, 3)

    def find(self, t: torch.Tensor, k: torch.Tensor, *, positions: bool = False) -> torch.Tensor:
        """Values of keys ``(t[i], k[i])``, or -1 where absent (bucket positions if asked).

        Probes the home bucket, then windows of 16 buckets per round: a key lies before the first
        empty bucket of its probe sequence, so the first match-or-empty in the window
        decides it.
        """
        n = k.numel()
        out = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        if n == 0 or self.size == 0:
            return out
        active = torch.arange(n, device=self.device)
        pos = self._home(t, k)
        at, ak, width = t, k, 1
        while True:
            p, rows = self._window(pos, width)
            ct = rows[..., 0]
            match = (ct == at.unsqueeze(1)) & (rows[..., 1] == ak.unsqueeze(1))
            stop = match | (ct == EMPTY)
            first = stop.to(torch.uint8).argmax(1, keepdim=True)
            found = match.gather(1, first).squeeze(1)
            src = p if positions else rows[..., 2]
            out[active[found]] = src.gather(1, first).squeeze(1)[found]
            go = ~stop.any(1)
            if not bool(go.any()):
                return out
            active, pos, at, ak = active[go], (pos[go] + width) & self.mask, at[go], ak[go]
            width = 16

    def insert(self, t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Insert distinct keys known to be absent."""
        n = k.numel()
        if n == 0:
            return
        assert self.size + n <= self.capacity, "KeyIndex over capacity"
        if self.size + self.tombstones + n > (self.nbuckets * 3) // 4:
            self._rebuild()
        idx = torch.arange(n, device=self.device)
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
            self.tab[wpos] = torch.stack((at[won], ak[won], av[won]), 1)
            go = ~won
            if not bool(go.any()):
                break
            # losers retry from the bucket they lost (now taken); full windows move on
            nxt = torch.where(has, cand, (pos + width) & self.mask)
            idx, pos, at, ak, av = idx[go], nxt[go], at[go], ak[go], av[go]
            width = 16
        self.size += n

    def remove(self, t: torch.Tensor, k: torch.Tensor) -> None:
        """Remove keys known to be present."""
        if k.numel() == 0:
            return
        pos = self.find(t, k, positions=True)
        assert bool((pos >= 0).all()), "KeyIndex.remove of an absent key"
        self.bt[pos] = TOMBSTONE
        self.size -= k.numel()
        self.tombstones += k.numel()

    def set_values(self, t: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Change the values of keys known to be present."""
        pos = self.find(t, k, positions=True)
        assert bool((pos >= 0).all()), "KeyIndex.set_values of an absent key"
        self.bv[pos] = v

    def items(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        live = self.bt >= 0
        return self.bt[live], self.bk[live], self.bv[live]

    def _rebuild(self) -> None:
        t, k, v = self.items()
        self.bt.fill_(EMPTY)
        self.size = self.tombstones = 0
        self.insert(t, k, v)

    def nbytes(self) -> int:
        return 3 * 8 * self.nbuckets
