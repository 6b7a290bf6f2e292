"""A fixed-capacity tier of row slots: the device tier and the host tier are both one.

The tier owns its slots (a float32 tensor ``[capacity, width]``), the key of each slot,
its dirty bit and pin count, a :class:`~hiermem.index.KeyIndex` from keys to slots, and
the eviction policy that scores its slots.  It moves whole batches of rows in and out;
what goes where is decided by the store.  Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..eviction import PolicySpec
from ..index import KeyIndex
from ..types import Tier


@dataclass
class Rows:
    """Rows in transit between tiers: keys, records, dirty bits and policy state."""

    t: torch.Tensor
    k: torch.Tensor
    rec: torch.Tensor
    dirty: torch.Tensor
    carried: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.k.numel()

    def to(self, device: torch.device) -> "Rows":
        c = None if self.carried is None else self.carried.to(device)
        return Rows(self.t.to(device), self.k.to(device), self.rec.to(device), self.dirty.to(device), c)


class SlotTier:
    """``capacity`` slots of ``width`` floats on ``device``."""

    def __init__(self, tier: Tier, capacity: int, width: int, device: torch.device,
                 policy: PolicySpec, pin_memory: bool = False):
        self.tier = tier
        self.capacity = int(capacity)
        self.width = int(width)
        self.device = torch.device(device)
        self.data = torch.zeros((self.capacity, self.width), dtype=torch.float32, device=self.device,
                                pin_memory=pin_memory and self.device.type == "cpu")
        self.keys_t = torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        self.keys_k = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.dirty = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        self.pins = torch.zeros(self.capacity, dtype=torch.int32, device=self.device)
        self.index = KeyIndex(self.capacity, self.device)
        self.policy = policy.build(self.capacity, self.device)
        self._free = torch.arange(self.capacity - 1, -1, -1, dtype=torch.int64, device=self.device)
        self.nfree = self.capacity

    @property
    def occupancy(self) -> int:
        return self.capacity - self.nfree

    def find(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Slot of each key, -1 where the row is not in this tier."""
        return self.index.find(t, k)

    def evictable(self, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """Occupied, unpinned slots not in ``exclude`` (a bool mask per slot)."""
        m = (self.keys_t >= 0) & (self.pins == 0)
        if exclude is not None:
            m &= ~exclude
        return m

    def slot_mask(self, slots: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        m[slots] = True
        return m

    def take(self, slots: torch.Tensor, with_records: bool = True) -> Rows:
        """Remove the rows in ``slots`` from the tier and return them."""
        rows = Rows(self.keys_t.index_select(0, slots), self.keys_k.index_select(0, slots),
                    self.data.index_select(0, slots) if with_records else self.data[:0],
                    self.dirty.index_select(0, slots), self.policy.carry(slots))
        self.index.remove(rows.t, rows.k)
        self.policy.on_remove(slots)
        self.keys_t[slots] = -1
        self.dirty[slots] = False
        n = slots.numel()
        self._free[self.nfree:self.nfree + n] = slots
        self.nfree += n
        return rows

    def put(self, rows: Rows, clock: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Place rows (absent from this tier) into free slots; returns the slots.

        Policy state comes from ``rows.carried`` when set, else from ``clock``/``counts``.
        """
        n = len(rows)
        assert n <= self.nfree, "SlotTier.put without room"
        slots = self._free[self.nfree - n:self.nfree].clone()
        self.nfree -= n
        w = rows.rec.shape[1]
        if w == self.width:
            self.data.index_copy_(0, slots, rows.rec)
        else:
            self.data[:, :w].index_copy_(0, slots, rows.rec)
        self.keys_t[slots] = rows.t
        self.keys_k[slots] = rows.k
        self.dirty[slots] = rows.dirty
        self.index.insert(rows.t, rows.k, slots)
        if rows.carried is not None:
            self.policy.on_carry_in(slots, rows.carried)
        else:
            self.policy.on_insert(slots, clock, counts)
        return slots

    def occupied(self) -> torch.Tensor:
        return (self.keys_t >= 0).nonzero().squeeze(1)

    def nbytes(self) -> int:
        return self.data.numel() * 4 + self.index.nbytes() + self.capacity * 21
