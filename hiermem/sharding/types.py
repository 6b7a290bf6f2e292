"""Value types of the planner and of sharded execution: enums, topology, tables, plans.

Everything here is a frozen dataclass or an enum; a :class:`ShardingPlan` round-trips
through JSON (``to_json`` / ``from_json``), so a plan made on one machine runs on another.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

from ..errors import HierMemError, InvalidArgumentError, InvalidTypeError

GIB = float(1 << 30)


class ShardingType(enum.Enum):
    """How one table is split over ranks."""

    TABLE_WISE = "TW"  #: the whole table on one rank
    ROW_WISE = "RW"  #: rows split over every rank (``id % world``); partial sums reduced
    COLUMN_WISE = "CW"  #: column slices on a few ranks; outputs concatenated
    DATA_PARALLEL = "DP"  #: replicated on every rank; row gradients gathered by all
    TABLE_ROW_WISE = "TWRW"  #: rows split over the ranks of one host (``id % ranks_per_host``)


class TierPlacement(enum.Enum):
    """Where a shard's rows live in its rank's :class:`~hiermem.HierarchicalStore`."""

    DEVICE = "device"  #: every row in device memory
    CACHED = "cached"  #: a device cache of ``device_rows`` over the shard held in host memory
    HOST = "host"  #: host-resident (device tier only stages a batch)
    SSD = "ssd"  #: LMDB on SSD, with device and host caches


class PlannerErrorKind(enum.Enum):
    """Why planning failed."""

    INSUFFICIENT_MEMORY = "insufficient_memory"  #: no option of a table fits the budgets left
    BAD_INPUT = "bad_input"  #: the tables or the topology do not make sense


class PlannerError(HierMemError):
    """No plan fits: names the table and the shortfall (or the bad input)."""

    def __init__(self, message: str, kind: PlannerErrorKind = PlannerErrorKind.INSUFFICIENT_MEMORY,
                 table: Optional[str] = None, shortfall_bytes: Optional[float] = None):
        super().__init__(message)
        self.kind = kind
        self.table = table
        self.shortfall_bytes = shortfall_bytes


def _positive(obj, names: Sequence[str], allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidTypeError(f"{type(obj).__name__}.{n} must be a number, got {v!r}")
        if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
            raise InvalidArgumentError(f"{type(obj).__name__}.{n} must be {'>= 0' if allow_zero else '> 0'}, "
                                       f"got {v}")


@dataclass(frozen=True)
class Topology:
    """The machines: ranks, per-rank memory budgets (bytes) and bandwidths (bytes/s).

    Defaults describe an 8-GPU host of the paper's class (80 GB HBM, 1 TB host memory
    and 2 TB SSD shared by 8 ranks, NVLink within a host, 100 Gb/s per rank across).
    ``call_overhead_s`` is the fixed cost of one shard lookup or update call (kernel
    launches, Python), ``collective_latency_s`` that of one collective, and
    ``step_overhead_s`` the fixed cost of a step beyond its collectives.
    ``concurrency``: how many ranks truly run at once (0: all); below ``world_size`` when
    local ranks share fewer free CPU cores, so a step costs at least the total work over
    ``concurrency`` (``calibrate`` measures it).
    """

    world_size: int
    ranks_per_host: int = 8
    device_bytes: float = 80e9
    host_bytes: float = 128e9
    ssd_bytes: float = 256e9
    device_bw: float = 2.0e12
    host_bw: float = 100e9
    device_host_bw: float = 25e9
    ssd_bw: float = 3e9
    intra_host_bw: float = 200e9
    inter_host_bw: float = 12.5e9
    call_overhead_s: float = 20e-6
    collective_latency_s: float = 30e-6
    step_overhead_s: float = 0.0
    concurrency: float = 0.0

    @property
    def parallel_ranks(self) -> float:
        """Ranks that really compute at once (``concurrency``; 0 means all of them)."""
        return min(float(self.world_size), self.concurrency) if self.concurrency > 0 else float(self.world_size)

    def __post_init__(self) -> None:
        for n in ("world_size", "ranks_per_host"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"Topology.{n} must be a positive int, got {v!r}")
        if self.world_size % self.ranks_per_host and self.world_size > self.ranks_per_host:
            raise InvalidArgumentError(f"world_size {self.world_size} is not a multiple of ranks_per_host "
                                       f"{self.ranks_per_host}")
        if self.ranks_per_host > self.world_size:
            object.__setattr__(self, "ranks_per_host", self.world_size)
        _positive(self, ("device_bw", "host_bw", "device_host_bw", "ssd_bw", "intra_host_bw", "inter_host_bw"))
        _positive(self, ("device_bytes", "host_bytes", "ssd_bytes", "call_overhead_s", "collective_latency_s",
                         "step_overhead_s", "concurrency"),
                  allow_zero=True)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.ranks_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.ranks_per_host

    def host_ranks(self, host: int) -> tuple[int, ...]:
        return tuple(range(host * self.ranks_per_host, (host + 1) * self.ranks_per_host))

    @property
    def all_to_all_bw(self) -> float:
        """Bandwidth of one rank's share of an all-to-all with every rank (mixed links)."""
        w, h = self.world_size, self.ranks_per_host
        if w == 1:
            return self.intra_host_bw
        intra, inter = (h - 1) / (w - 1), (w - h) / (w - 1)
        return 1.0 / (intra / self.intra_host_bw + inter / self.inter_host_bw)


@dataclass(frozen=True)
class PlannerTable:
    """A table as the planner sees it.

    Args:
        name: the table (and feature) name.
        num_rows: rows (for an unbounded table: the expected number of distinct rows).
        dim: embedding dimension.
        pooling_factor: mean ids per bag.
        zipf_alpha: access skew, used for hit rates when there is no curve.
        miss_ratio_curve: optional measured ``((cache_rows, miss_ratio), ...)`` (e.g. from
            the simulator's trace), interpolated log-linearly in ``cache_rows``.
    """

    name: str
    num_rows: int
    dim: int
    pooling_factor: float = 1.0
    zipf_alpha: float = 1.05
    miss_ratio_curve: Optional[tuple[tuple[float, float], ...]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError("PlannerTable.name must be a non-empty string")
        for n in ("num_rows", "dim"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"table {self.name}: {n} must be a positive int, got {v!r}")
        _positive(self, ("pooling_factor", "zipf_alpha"))
        if self.miss_ratio_curve is not None:
            pts = tuple(sorted((float(c), float(m)) for c, m in self.miss_ratio_curve))
            if not pts or any(c < 0 or not 0 <= m <= 1 for c, m in pts):
                raise InvalidArgumentError(f"table {self.name}: miss_ratio_curve needs (rows >= 0, 0 <= miss <= 1)")
            object.__setattr__(self, "miss_ratio_curve", pts)

    @classmethod
    def from_spec(cls, spec, pooling_factor: float = 1.0, rows: Optional[int] = None, **kw) -> "PlannerTable":
        """From a :class:`~hiermem.TableSpec` (``rows`` required for an unbounded table)."""
        n = spec.num_rows if spec.num_rows is not None else rows
        if n is None:
            raise PlannerError(f"table {spec.name} is unbounded: give its expected distinct rows",
                               PlannerErrorKind.BAD_INPUT, spec.name)
        return cls(spec.name, int(n), spec.dim, pooling_factor, **kw)


@dataclass(frozen=True)
class ShardPlan:
    """One shard: which rank, which rows and columns, which tiers, and its estimates.

    Rows: a row ``id`` belongs to this shard when ``id % row_parts == row_part``.
    Columns ``[col_start, col_start + col_width)``.
    """

    rank: int
    row_part: int = 0
    row_parts: int = 1
    col_start: int = 0
    col_width: int = 0
    tier: TierPlacement = TierPlacement.DEVICE
    device_rows: int = 0
    host_rows: int = 0
    est_ms: float = 0.0
    device_bytes: float = 0.0
    host_bytes: float = 0.0
    ssd_bytes: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tier"] = self.tier.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ShardPlan":
        return cls(**{**d, "tier": TierPlacement(d["tier"])})


@dataclass(frozen=True)
class TablePlan:
    """How one table is sharded."""

    name: str
    sharding: ShardingType
    shards: tuple[ShardPlan, ...]
    dim: int = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({s.rank for s in self.shards}))

    def to_dict(self) -> dict:
        return {"name": self.name, "sharding": self.sharding.value, "dim": self.dim,
                "shards": [s.to_dict() for s in self.shards]}

    @classmethod
    def from_dict(cls, d: dict) -> "TablePlan":
        return cls(d["name"], ShardingType(d["sharding"]), tuple(ShardPlan.from_dict(s) for s in d["shards"]),
                   int(d.get("dim", 0)))


@dataclass(frozen=True)
class ShardingPlan:
    """A frozen, JSON-serialisable plan: one :class:`TablePlan` per table, in table order.

    ``rank_ms`` holds the cost model's estimated step time of every rank.
    """

    world_size: int
    ranks_per_host: int
    tables: tuple[TablePlan, ...]
    rank_ms: tuple[float, ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for t in self.tables:
            for s in t.shards:
                if not 0 <= s.rank < self.world_size:
                    raise InvalidArgumentError(f"table {t.name}: shard on rank {s.rank} outside world "
                                               f"{self.world_size}")

    def table(self, name: str) -> TablePlan:
        for t in self.tables:
            if t.name == name:
                return t
        raise InvalidArgumentError(f"plan has no table {name!r}")

    @property
    def estimated_ms(self) -> float:
        """The estimated step time: the slowest rank's, or the total work over the ranks
        that truly run at once when that is more (``meta["step_ms"]``)."""
        return float(self.meta.get("step_ms", max(self.rank_ms) if self.rank_ms else 0.0))

    def rank_bytes(self) -> list[dict[str, float]]:
        """Estimated bytes per tier on every rank."""
        out = [{"device": 0.0, "host": 0.0, "ssd": 0.0} for _ in range(self.world_size)]
        for t in self.tables:
            for s in t.shards:
                o = out[s.rank]
                o["device"] += s.device_bytes
                o["host"] += s.host_bytes
                o["ssd"] += s.ssd_bytes
        return out

    def with_meta(self, **meta) -> "ShardingPlan":
        return replace(self, meta={**self.meta, **meta})

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "ranks_per_host": self.ranks_per_host,
                "rank_ms": list(self.rank_ms), "meta": self.meta, "tables": [t.to_dict() for t in self.tables]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: dict) -> "ShardingPlan":
        return cls(int(d["world_size"]), int(d["ranks_per_host"]), tuple(TablePlan.from_dict(t) for t in d["tables"]),
                   tuple(float(x) for x in d.get("rank_ms", ())), dict(d.get("meta", {})))

    @classmethod
    def from_json(cls, s: str) -> "ShardingPlan":
        return cls.from_dict(json.loads(s))
