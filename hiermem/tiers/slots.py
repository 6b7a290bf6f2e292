"""A fixed-capacity tier of row slots: the device tier and the host tier are both one.

The tier owns its slots: the row data (a float32 tensor ``[capacity, width]`` on the
tier's device: the data plane; the host tier keeps records at each table's own width
instead, :mod:`hiermem.tiers.host`) and, on the CPU as numpy arrays (the control plane),
each slot's key ``(keys_t, keys_k)``, dirty bit, pin count, the free-slot stack, and the
eviction policy that scores its slots.  ``keys_t``, ``keys_k``, ``dirty`` and ``pins`` are
also exposed as CPU tensors sharing that memory.  What goes where is decided by the
kernels of :mod:`hiermem.core.plan` over :attr:`SlotTier.state`; the tier only executes
copies and answers questions.  Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.index import as_array
from ..core.jit import kernel
from ..core.layout import RECORD, slot_records
from ..core.plan import BASE, CAP, NFREE, NPINNED
from ..core.policies import PolicySpec
from ..types import Tier


@dataclass
class Rows:
    """Rows on their way to LMDB: keys, records and dirty bits (CPU)."""

    t: torch.Tensor
    k: torch.Tensor
    rec: torch.Tensor
    dirty: torch.Tensor

    def __len__(self) -> int:
        return self.k.numel()


def by_tier(g: np.ndarray, dev: "SlotTier", host: "SlotTier") -> tuple:
    """``((host, its slots), (device, its slots))`` of global slots ``g`` (int64 numpy)."""
    on_host = g >= host.base
    return (host, g[on_host] - host.base), (dev, g[~on_host])


def by_table(t: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``[(table, positions)]`` of table codes ``t`` (int, numpy), tables ascending, each
    table's positions in their order in ``t``: one stable sort, not a pass per table."""
    if t.size == 0:
        return []
    order = np.argsort(t, kind="stable")
    ts = t[order]
    cuts = [0, *(np.flatnonzero(ts[1:] != ts[:-1]) + 1).tolist(), t.size]
    return [(int(ts[a]), order[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def table_groups(t: np.ndarray, k: np.ndarray, rec: np.ndarray, widths: list[int]) -> list:
    """``[(table, ids, records at the table's width)]`` of rows ``(t, k)`` with records
    ``rec`` (``[n, W]``, the first ``widths[table]`` columns meaningful), by :func:`by_table`."""
    return [(ti, k[m], rec[m, :widths[ti]]) for ti, m in by_table(t)]


class SlotTier:
    """``capacity`` slots of ``width`` floats on ``device``; global slots start at ``base``."""

    def __init__(self, tier: Tier, capacity: int, width: int, device: torch.device,
                 policy: PolicySpec, base: int, pin_memory: bool = False):
        self.tier = tier
        self.capacity = C = int(capacity)
        self.width = int(width)
        self.device = torch.device(device)
        self.data = torch.zeros((C, self.width), dtype=torch.float32, device=self.device,
                                pin_memory=pin_memory and self.device.type == "cpu")
        self.base = int(base)
        # one 32-byte record per slot (hiermem.core.layout): a row changing tier touches
        # one cache line of its old slot's state and one of its new slot's
        kt, kk, key, pins, dirty, mark = slot_records(C)
        free = np.arange(C - 1, -1, -1, dtype=np.int64)
        self.meta = np.array([C, 0, C, self.base], dtype=np.int64)  # nfree, npinned, capacity, base
        self.state = (kt, kk, dirty, pins, free, self.meta, mark)
        self.keys_t, self.keys_k = torch.from_numpy(kt[:C]), torch.from_numpy(kk[:C])
        self.dirty, self.pins = torch.from_numpy(dirty[:C]), torch.from_numpy(pins[:C])
        self.policy = policy.build(C)
        self.policy.adopt_keys(key)
        if tier == Tier.DEVICE:  # the admission filter guards the device tier only
            self.policy.attach_admission()
        assert self.meta[CAP] == C and self.meta[BASE] == self.base

    @property
    def nfree(self) -> int:
        return int(self.meta[NFREE])

    @property
    def occupancy(self) -> int:
        return self.capacity - self.nfree

    @property
    def pinned(self) -> int:
        """Slots holding a pinned row."""
        return int(self.meta[NPINNED])

    def g(self, slots: torch.Tensor) -> torch.Tensor:
        """Global slot numbers."""
        return slots.cpu() + self.base

    def pin(self, slots, delta: int) -> None:
        """Add ``delta`` to the pin counts of ``slots`` (distinct, occupied)."""
        s = as_array(slots)
        if s.size:
            self.meta[NPINNED] += _pin_add(self.state[3], s, delta)

    def occupied(self) -> torch.Tensor:
        return (self.keys_t >= 0).nonzero().squeeze(1)

    def clear(self) -> None:
        """Empty every slot (the rows are dropped; the caller clears the index)."""
        kt, _, dirty, pins, free, meta, _ = self.state
        kt[:] = -1
        dirty[:] = False
        pins[:] = 0
        free[:] = np.arange(self.capacity - 1, -1, -1)
        meta[NFREE], meta[NPINNED] = self.capacity, 0
        self.policy.reset()

    def read(self, slots: torch.Tensor, cols: int) -> torch.Tensor:
        """Records ``[n, cols]`` of ``slots`` (on the tier's device)."""
        src = self.data if cols == self.width else self.data[:, :cols]
        return src.index_select(0, slots.to(self.device))

    def write(self, slots: torch.Tensor, rec: torch.Tensor) -> None:
        """Write ``rec [n, w]`` to the first ``w`` floats of the records of ``slots``."""
        w = rec.shape[1]
        dst = self.data if w == self.width else self.data[:, :w]
        dst.index_copy_(0, slots.to(self.device), rec.to(self.device))

    def update(self, slots: torch.Tensor, width: int, fn) -> None:
        """``fn(data, rows)`` changes records ``rows`` of a ``[*, >= width]`` tensor in
        place: here straight on the tier's tensor."""
        fn(self.data, slots)

    def record_bytes(self) -> int:
        """Bytes of record storage allocated."""
        return self.data.numel() * 4

    def occupied_bytes(self, resident: list[int], widths: list[int]) -> int:
        """Bytes of the slots of the resident rows (``resident[t]`` rows of table ``t``)."""
        return sum(resident) * self.width * 4

    def nbytes(self) -> int:
        return self.record_bytes() + self.capacity * (RECORD + 8)  # slot record, free stack


@kernel
def _pin_add(pins, slots, delta):
    """Add ``delta`` to ``pins[slots]`` (distinct slots); the change in pinned slots."""
    change = 0
    for i in range(slots.size):
        s = slots[i]
        before = pins[s]
        after = before + delta
        pins[s] = after
        change += (1 if after > 0 else 0) - (1 if before > 0 else 0)
    return change
