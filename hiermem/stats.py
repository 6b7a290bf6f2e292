"""Store counters: plain int64 tensors indexed by IntEnums, bumped on the hot path.

Per table and tier (``Stat``), with these denominators, so conditional hit rates are
unambiguous (``hits / lookups`` of the same tier):

* ``device.lookups``: every id looked up, duplicates included.
* ``device.misses``: distinct rows of a batch not resident in the device tier at the
  start of that batch (a row fetched once serves all its duplicates: those count as hits).
* ``device.hits = device.lookups - device.misses``.
* ``host.lookups = device.misses``; ``host.hits``: of those, rows found in the host tier.
* ``disk.lookups = host.misses``; ``disk.hits``: rows read from LMDB; ``disk.misses``:
  rows never written, created by the initialiser.
* ``evictions``: rows that left the tier for the one below (device -> host, host ->
  disk); ``writebacks``: of those, the dirty ones (carried down, or written to LMDB).

Store-wide counters (``IO``) count bytes moved per tier pair and flushes.
"""

from __future__ import annotations

import enum

import torch

from .types import Tier

SLOT_TIERS = (Tier.DEVICE, Tier.HOST)
STAT_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class Stat(enum.IntEnum):
    LOOKUPS = 0
    HITS = 1
    MISSES = 2
    EVICTIONS = 3
    WRITEBACKS = 4


class IO(enum.IntEnum):
    BYTES_HOST_TO_DEVICE = 0
    BYTES_DEVICE_TO_HOST = 1
    BYTES_DISK_TO_HOST = 2
    BYTES_HOST_TO_DISK = 3
    FLUSHES = 4
    FLUSHED_ROWS = 5
    UPDATES = 6
    UPDATED_ROWS = 7


class Counters:
    """``table x tier x Stat`` and store-wide ``IO`` counters (CPU int64)."""

    def __init__(self, num_tables: int):
        self.num_tables = num_tables
        self.table = torch.zeros((num_tables, len(STAT_TIERS), len(Stat)), dtype=torch.int64)
        self.io = torch.zeros(len(IO), dtype=torch.int64)

    def bump(self, tier: Tier, stat: Stat, t: torch.Tensor | int, n: int | None = None) -> None:
        """Add ``n`` to table ``t`` (an int), or one per element of tensor ``t``."""
        if isinstance(t, int):
            if n:
                self.table[t, tier, stat] += n
        elif t.numel():
            self.table[:, tier, stat] += torch.bincount(t.cpu(), minlength=self.num_tables)

    def add_io(self, what: IO, n: int) -> None:
        self.io[what] += int(n)
