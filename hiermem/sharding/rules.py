"""One rule per sharding type and one per tier: what the planner's stages ask of each.

A :class:`ShardingRule` answers, for its :class:`ShardingType`: which shapes a table
may take (:meth:`~ShardingRule.shapes`), which ranks its shards go to given every
rank's load (:meth:`~ShardingRule.ranks`), which rows and columns shard ``k`` holds
(:meth:`~ShardingRule.layout`), and the memory it lacks when nothing fits
(:meth:`~ShardingRule.shortfall`).  A :class:`TierRule` lists the tier placements
(:class:`TierChoice`) of one :class:`TierPlacement` for a shard.  The planner reads the
registries :data:`SHARDING_RULES` and :data:`TIER_RULES`; adding a sharding type or a
tier is one new rule there (its cost in :mod:`.cost` aside).  Rules are stateless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .cost import ShardShape, TierChoice, shard_shape
from .types import PlannerTable, ShardingType, TierPlacement, Topology

#: Column shards of a CW option (each at least :data:`MIN_CW_DIM` wide).
CW_SPLITS = (2, 4, 8)
MIN_CW_DIM = 4
_TIERS = ("device", "host", "ssd")


@dataclass(frozen=True)
class Shape:
    """One way to cut a table: ``nshards`` shards of column ``widths``, each serving ``shape``."""

    sharding: ShardingType
    nshards: int
    widths: tuple[int, ...]
    shape: ShardShape


@dataclass(frozen=True)
class Layout:
    """Rows ``id % row_parts == row_part`` and columns ``[col_start, col_start + width)``."""

    row_part: int
    row_parts: int
    col_start: int
    width: int


class ShardingRule(Protocol):
    """What the planner needs to know about one sharding type."""

    sharding: ShardingType

    def shapes(self, table: PlannerTable, topo: Topology, batch: int,
               allowed: Sequence[ShardingType]) -> list[Shape]:
        """The shapes this sharding offers for ``table`` (none: not applicable)."""

    def ranks(self, nshards: int, secs: np.ndarray, new: np.ndarray, cur: float, topo: Topology) -> list[int]:
        """The ranks of the shards given ``secs`` [W] (a shard's seconds on each rank),
        ``new`` [W] (load with it) and ``cur`` (the slowest rank's load now)."""

    def layout(self, k: int, nranks: int, widths: tuple[int, ...], dim: int) -> Layout:
        """Rows and columns of shard ``k`` of ``nranks``."""

    def shortfall(self, deficit: np.ndarray, nshards: int) -> tuple[float, str]:
        """Bytes missing and the tier short of most, from ``deficit`` [W, 3] per rank."""


def _all_ranks_shortfall(deficit: np.ndarray, per: np.ndarray) -> tuple[float, str]:
    return float(per.max()), _TIERS[int(deficit.sum(0).argmax())]


def _full(k: int, nranks: int, widths, dim: int) -> Layout:
    return Layout(0, 1, 0, dim)


@dataclass(frozen=True)
class TableWise:
    """The whole table on the rank that keeps the slowest rank fastest (then the least loaded)."""

    sharding: ShardingType = ShardingType.TABLE_WISE

    def shapes(self, table, topo, batch, allowed):
        return [Shape(self.sharding, 1, (table.dim,), shard_shape(table, self.sharding, topo, batch))]

    def ranks(self, nshards, secs, new, cur, topo):
        return [int(np.lexsort((new, np.maximum(new, cur)))[0])]

    layout = staticmethod(_full)

    def shortfall(self, deficit, nshards):
        per = deficit.sum(1)
        r = int(per.argmin())
        return float(per[r]), _TIERS[int(deficit[r].argmax())]


@dataclass(frozen=True)
class DataParallel:
    """A replica on every rank."""

    sharding: ShardingType = ShardingType.DATA_PARALLEL

    def shapes(self, table, topo, batch, allowed):
        W = topo.world_size
        return [Shape(self.sharding, W, (table.dim,) * W, shard_shape(table, self.sharding, topo, batch))]

    def ranks(self, nshards, secs, new, cur, topo):
        return list(range(topo.world_size))

    layout = staticmethod(_full)

    def shortfall(self, deficit, nshards):
        return _all_ranks_shortfall(deficit, deficit.sum(1))


@dataclass(frozen=True)
class RowWise:
    """Rows split over every rank (``id % world``)."""

    sharding: ShardingType = ShardingType.ROW_WISE

    def shapes(self, table, topo, batch, allowed):
        W = topo.world_size
        return [Shape(self.sharding, W, (table.dim,) * W, shard_shape(table, self.sharding, topo, batch, W))]

    def ranks(self, nshards, secs, new, cur, topo):
        return list(range(topo.world_size))

    def layout(self, k, nranks, widths, dim):
        return Layout(k, nranks, 0, dim)

    def shortfall(self, deficit, nshards):
        return _all_ranks_shortfall(deficit, deficit.sum(1))


@dataclass(frozen=True)
class TableRowWise:
    """Rows split over the ranks of the host that keeps the slowest rank fastest."""

    sharding: ShardingType = ShardingType.TABLE_ROW_WISE

    def shapes(self, table, topo, batch, allowed):
        H = topo.ranks_per_host
        if H == topo.world_size and ShardingType.ROW_WISE in allowed:
            return []  # one host: TWRW is RW
        return [Shape(self.sharding, H, (table.dim,) * H, shard_shape(table, self.sharding, topo, batch, H))]

    def ranks(self, nshards, secs, new, cur, topo):
        hosts = [list(topo.host_ranks(h)) for h in range(topo.num_hosts)]
        return min(hosts, key=lambda rs: (new[rs].max(), secs[rs].sum()))

    def layout(self, k, nranks, widths, dim):
        return Layout(k, nranks, 0, dim)

    def shortfall(self, deficit, nshards):
        return _all_ranks_shortfall(deficit, deficit.sum(1))


def cw_widths(dim: int, k: int) -> tuple[int, ...]:
    """``k`` column widths covering ``dim`` (the first ``dim % k`` one wider)."""
    base, extra = divmod(dim, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


@dataclass(frozen=True)
class ColumnWise:
    """Column slices (2, 4 or 8, each >= ``MIN_CW_DIM`` wide) on the least loaded ranks."""

    sharding: ShardingType = ShardingType.COLUMN_WISE

    def shapes(self, table, topo, batch, allowed):
        out = []
        for k in CW_SPLITS:
            if k > topo.world_size or table.dim // k < MIN_CW_DIM:
                continue
            widths = cw_widths(table.dim, k)
            out.append(Shape(self.sharding, k, widths, shard_shape(table, self.sharding, topo, batch, dim=widths[0])))
        return out

    def ranks(self, nshards, secs, new, cur, topo):
        return sorted(int(r) for r in np.argsort(new, kind="stable")[:nshards])

    def layout(self, k, nranks, widths, dim):
        return Layout(0, 1, sum(widths[:k]), widths[k])

    def shortfall(self, deficit, nshards):
        return _all_ranks_shortfall(deficit, np.sort(deficit.sum(1))[:nshards])


#: The rule of every sharding type, in :class:`ShardingType` order.
SHARDING_RULES: dict[ShardingType, ShardingRule] = {r.sharding: r for r in (
    TableWise(), RowWise(), ColumnWise(), DataParallel(), TableRowWise())}


# -- tiers ---------------------------------------------------------------------------------
def cache_grid(rows: int, lo: int = 1) -> list[int]:
    """Cache sizes to try: ``rows / 2``, then every quarter of that, at most 12."""
    out, c = [], rows // 2
    while c >= max(1, lo) and len(out) < 12:
        out.append(c)
        c //= 4
    return out


class TierRule(Protocol):
    """The placements of one tier for a shard of ``shape``."""

    tier: TierPlacement

    def choices(self, shape: ShardShape) -> list[TierChoice]:
        """Candidate (device rows, host rows) of this tier."""


@dataclass(frozen=True)
class DeviceTier:
    """Every row in device memory."""

    tier: TierPlacement = TierPlacement.DEVICE

    def choices(self, shape):
        return [TierChoice(self.tier, shape.rows, 1)]


@dataclass(frozen=True)
class HostTier:
    """Rows in host memory, a batch staged on the device."""

    tier: TierPlacement = TierPlacement.HOST

    def choices(self, shape):
        return [TierChoice(self.tier, 1, shape.rows)]


@dataclass(frozen=True)
class CachedTier:
    """A device cache of ``c`` rows over the rest in host memory, ``c`` on a grid."""

    tier: TierPlacement = TierPlacement.CACHED

    def choices(self, shape):
        n = shape.rows
        return [TierChoice(self.tier, c, n - c) for c in cache_grid(n)]


@dataclass(frozen=True)
class SsdTier:
    """LMDB on SSD behind device and host caches that hold at least a batch's rows."""

    tier: TierPlacement = TierPlacement.SSD

    def choices(self, shape):
        n = shape.rows
        need = int(np.ceil(min(float(n), shape.ids)))  # a batch's rows must be resident at once
        out = []
        for cd in cache_grid(n):
            for ch in (cache_grid(n) or [1])[::2]:
                if cd + ch >= need and cd + ch < n:
                    out.append(TierChoice(self.tier, cd, ch))
        return out


#: Tier rules in the order their choices are listed (ties keep this order).
TIER_RULES: tuple[TierRule, ...] = (DeviceTier(), HostTier(), CachedTier(), SsdTier())

__all__ = ["CW_SPLITS", "MIN_CW_DIM", "SHARDING_RULES", "TIER_RULES", "CachedTier", "ColumnWise", "DataParallel",
           "DeviceTier", "HostTier", "Layout", "RowWise", "Shape", "ShardingRule", "SsdTier", "TableRowWise",
           "TableWise", "TierRule", "cache_grid", "cw_widths"]
