"""A fixed-capacity tier of row slots: the device tier and the host tier are both one.

The tier owns its slots (a float32 tensor ``[capacity, width]``), the key of each slot,
its dirty bit and pin count, and the eviction policy that scores its slots.  The tiers of
a store share one :class:`~hiermem.index.SlotIndex` from keys to *global* slots (this
tier's slot ``s`` is global slot ``base + s``), so finding a batch's rows is one probe and
moving a row between tiers re-points its bucket instead of re-hashing it.  It moves whole batches of rows in and out;
what goes where is decided by the store.  Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..eviction import PolicySpec
from ..index import SlotIndex
from ..types import Tier


@dataclass
class Rows:
    """Rows in transit between tiers: keys, records, dirty bits and policy state."""

    t: torch.Tensor
    k: torch.Tensor
    rec: torch.Tensor
    dirty: torch.Tensor
    carried: torch.Tensor | None = None
    pins: torch.Tensor | None = None  # pin counts, carried when pinned rows move between tiers

    def __len__(self) -> int:
        return self.k.numel()

    def to(self, device: torch.device) -> "Rows":
        c = None if self.carried is None else self.carried.to(device)
        p = None if self.pins is None else self.pins.to(device)
        return Rows(self.t.to(device), self.k.to(device), self.rec.to(device), self.dirty.to(device), c, p)


class SlotTier:
    """``capacity`` slots of ``width`` floats on ``device``."""

    def __init__(self, tier: Tier, capacity: int, width: int, device: torch.device,
                 policy: PolicySpec, index: SlotIndex, base: int, pin_memory: bool = False):
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
        # slots with pins > 0, kept as a device scalar (no host sync per move): admission
        # reads it per prefetch, and a whole-tier scan of a host tier of millions of rows
        # would cost more than the prefetch itself
        self._npinned = torch.zeros((), dtype=torch.int64, device=self.device)
        self.index = index
        self.base = int(base)
        self.policy = policy.build(self.capacity, self.device)
        self._free = torch.arange(self.capacity - 1, -1, -1, dtype=torch.int64, device=self.device)
        self.nfree = self.capacity
        self.no_slots = torch.empty(0, dtype=torch.int64, device=self.device)

    @property
    def occupancy(self) -> int:
        return self.capacity - self.nfree

    def g(self, slots: torch.Tensor) -> torch.Tensor:
        """Global slot numbers (on the index's device)."""
        return slots.to(self.index.device) + self.base

    def candidates(self, exclude: torch.Tensor) -> "TierEvictable":
        """What may be evicted now: occupied, unpinned slots not in ``exclude`` (distinct
        occupied slots, the batch's own rows), answered per slot without a pass over the
        tier (an :class:`~hiermem.eviction.Evictable`)."""
        return TierEvictable(self, exclude)

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

    def take(self, slots: torch.Tensor, with_records: bool = True, unindex: bool = True) -> Rows:
        """Remove the rows in ``slots`` from the tier and return them.

        ``unindex=False`` leaves their index entries, to be re-pointed by the caller.
        """
        rows = Rows(self.keys_t.index_select(0, slots), self.keys_k.index_select(0, slots),
                    self.data.index_select(0, slots) if with_records else self.data[:0],
                    self.dirty.index_select(0, slots), self.policy.carry(slots), self.pins.index_select(0, slots))
        self._npinned -= (rows.pins > 0).sum()
        if unindex:
            self.index.remove_slots(self.g(slots))
        self.policy.on_remove(slots)
        self.keys_t[slots] = -1
        self.dirty[slots] = False
        self.pins[slots] = 0
        n = slots.numel()
        self._free[self.nfree:self.nfree + n] = slots
        self.nfree += n
        return rows

    def put(self, rows: Rows, clock: torch.Tensor | None = None, counts: torch.Tensor | None = None,
            index: bool = True) -> torch.Tensor:
        """Place rows (absent from this tier) into free slots; returns the slots.

        New rows are added to the index; rows moved from another tier (taken with
        ``unindex=False``) pass ``index=False`` and the caller re-points their entries
        with :meth:`SlotIndex.move_slots`.  Policy state comes from ``rows.carried``
        when set, else from ``clock``/``counts``.
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
        if rows.pins is None:
            self.pins[slots] = 0
        else:
            self.pins[slots] = rows.pins
            self._npinned += (rows.pins > 0).sum()
        if index:
            self.index.insert(rows.t.to(self.index.device), rows.k.to(self.index.device), self.g(slots))
        if rows.carried is not None:
            self.policy.on_carry_in(slots, rows.carried)
        else:
            self.policy.on_insert(slots, clock, counts)
        return slots

    def pin(self, slots: torch.Tensor, delta: int) -> None:
        """Add ``delta`` to the pin counts of ``slots`` (distinct, occupied)."""
        before = self.pins.index_select(0, slots)
        after = before + delta
        self.pins[slots] = after
        self._npinned += (after > 0).sum() - (before > 0).sum()

    @property
    def pinned(self) -> int:
        """Slots holding a pinned row."""
        return int(self._npinned)

    def occupied(self) -> torch.Tensor:
        return (self.keys_t >= 0).nonzero().squeeze(1)

    def nbytes(self) -> int:
        return self.data.numel() * 4 + self.capacity * 21


class TierEvictable:
    """:meth:`SlotTier.candidates`: the tier's evictable slots, per slot and counted."""

    def __init__(self, tier: SlotTier, exclude: torch.Tensor):
        self.tier, self.exclude = tier, exclude
        held = tier._npinned + (tier.pins.index_select(0, exclude) == 0).sum()
        self.held = int(held)
        self.count = tier.occupancy - self.held

    def at(self, slots: torch.Tensor) -> torch.Tensor:
        t = self.tier
        ok = (t.keys_t.index_select(0, slots) >= 0) & (t.pins.index_select(0, slots) == 0)
        if self.exclude.numel():
            ok &= ~torch.isin(slots, self.exclude)
        return ok

    def occupied(self) -> torch.Tensor:
        return self.tier.keys_t >= 0

    def mask(self) -> torch.Tensor:
        return self.tier.evictable(self.tier.slot_mask(self.exclude))
