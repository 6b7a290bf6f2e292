"""The cost model: pure functions from frozen inputs to additive time and memory.

Per shard and step (``b`` samples per rank, ``W`` ranks, pooling factor ``L``), matching
what :class:`~hiermem.sharding.ShardedEmbeddingBagCollection` does:

* **compute**: read ``ids * d`` floats of rows (at the tier mixture's bandwidth given the
  expected hit rate), write ``bags * d`` pooled floats; backward reads the pooled
  gradients and reads+writes every distinct row's record; plus a fixed call overhead.
* **communication**: ids in (8 bytes each), pooled rows out and pooled gradients back
  (``bags * d * 4`` each) over the all-to-all bandwidth; data-parallel tables instead
  all-gather every rank's distinct-row gradients.
* **prefetch**: rows missing from the device cache move up (and their dirty victims
  down): host<->device copies, SSD reads and writes.

Hit rates come from a table's miss-ratio curve when it has one (e.g. from the
simulator), else from a Zipf(``alpha``) fit: the ideal hit rate of the ``c`` hottest of
``n`` rows is ``H(c)/H(n)`` with ``H`` the generalised harmonic number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .types import PlannerTable, ShardingType, TierPlacement, Topology

#: LMDB keeps each record with its key and B-tree pages: bytes on SSD per record byte.
SSD_OVERHEAD = 1.5


@dataclass(frozen=True)
class Perf:
    """Estimated seconds per step of one shard on its rank (additive)."""

    compute: float = 0.0
    comm: float = 0.0
    prefetch: float = 0.0

    def __add__(self, o: "Perf") -> "Perf":
        return Perf(self.compute + o.compute, self.comm + o.comm, self.prefetch + o.prefetch)

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.prefetch


@dataclass(frozen=True)
class Storage:
    """Bytes per tier of one shard on its rank (additive)."""

    device: float = 0.0
    host: float = 0.0
    ssd: float = 0.0

    def __add__(self, o: "Storage") -> "Storage":
        return Storage(self.device + o.device, self.host + o.host, self.ssd + o.ssd)

    def fits_in(self, o: "Storage") -> bool:
        return self.device <= o.device and self.host <= o.host and self.ssd <= o.ssd


@dataclass(frozen=True)
class OptimizerCost:
    """What the cost model needs of an optimizer: state floats per row, row statistic."""

    state_per_dim: int = 0
    state_fixed: int = 0
    row_stat: bool = False

    @classmethod
    def of(cls, optimizer) -> "OptimizerCost":
        import torch

        s0, s1 = optimizer.state_width(0), optimizer.state_width(1)
        return cls(s1 - s0, s0, optimizer.row_statistic(torch.zeros(0, 1), 1) is not None)

    def state_width(self, dim: int) -> int:
        return self.state_per_dim * dim + self.state_fixed


@dataclass(frozen=True)
class ShardShape:
    """The part of a table one shard holds and serves: rows, columns, traffic."""

    rows: int  # rows the shard holds
    dim: int  # columns the shard holds
    full_dim: int
    ids: float  # ids it looks up per step
    bags: float  # pooled rows it produces per step
    row_parts: int = 1  # its share of the table's rows is 1 / row_parts


@dataclass(frozen=True)
class TierChoice:
    """A tier placement with its cache sizes (rows)."""

    tier: TierPlacement
    device_rows: int
    host_rows: int


def _harmonic(n: float, a: float) -> float:
    """``sum_{i=1..n} i**-a`` (Euler-Maclaurin, exact enough for hit rates)."""
    if n <= 0:
        return 0.0
    if n < 16:
        return sum(i ** -a for i in range(1, int(n) + 1))
    h = sum(i ** -a for i in range(1, 16))
    lo = 15.5
    if abs(a - 1.0) < 1e-9:
        return h + math.log((n + 0.5) / lo)
    return h + ((n + 0.5) ** (1 - a) - lo ** (1 - a)) / (1 - a)


def hit_rate(table: PlannerTable, cache_rows: float, row_parts: int = 1) -> float:
    """Expected hit rate of a cache of ``cache_rows`` over a ``1/row_parts`` row shard.

    A modulo row split keeps each part's popularity ranking, so a part's cache of ``c``
    behaves like a whole-table cache of ``c * row_parts``.
    """
    c = max(0.0, cache_rows) * row_parts
    if c >= table.num_rows:
        return 1.0
    if table.miss_ratio_curve:
        pts = table.miss_ratio_curve
        if c <= pts[0][0]:  # below the first point: linear from (0 rows, all miss)
            return (1.0 - pts[0][1]) * (c / pts[0][0] if pts[0][0] > 0 else 1.0)
        for (c0, m0), (c1, m1) in zip(pts, pts[1:]):
            if c <= c1:
                f = (math.log1p(c) - math.log1p(c0)) / max(math.log1p(c1) - math.log1p(c0), 1e-12)
                return 1.0 - (m0 + f * (m1 - m0))
        return 1.0 - pts[-1][1]
    return _harmonic(c, table.zipf_alpha) / _harmonic(table.num_rows, table.zipf_alpha)


def shard_shape(table: PlannerTable, sharding: ShardingType, topo: Topology, batch: int, parts: int = 1,
                dim: int | None = None) -> ShardShape:
    """The rows, columns and per-step traffic of one shard of ``table``."""
    W, L = topo.world_size, table.pooling_factor
    d = table.dim if dim is None else dim
    if sharding is ShardingType.DATA_PARALLEL:
        return ShardShape(table.num_rows, d, table.dim, batch * L, batch)
    if sharding in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
        return ShardShape(math.ceil(table.num_rows / parts), d, table.dim, W * batch * L / parts, W * batch, parts)
    return ShardShape(table.num_rows, d, table.dim, W * batch * L, W * batch)


def distinct_rows(table: PlannerTable, shape: ShardShape) -> float:
    """Expected distinct rows among a step's ids under the table's Zipf(``alpha``) skew.

    ``sum_i 1 - exp(-ids * p_i)`` over the shard's rows, summed over geometric rank bins
    (a modulo row split gives every part the same skew).
    """
    import numpy as np

    n, ids, a = shape.rows, shape.ids, table.zipf_alpha
    if ids <= 0:
        return 0.0
    edges = np.unique(np.geomspace(1, n + 1, num=min(n + 1, 96)).astype(np.int64))
    lo, hi = edges[:-1], edges[1:]
    mid = np.sqrt(lo * np.maximum(hi - 1, lo)).astype(float)
    p = mid ** -a / _harmonic(n, a)
    return float(np.minimum(((hi - lo) * (1.0 - np.exp(-ids * p))).sum(), min(n, ids)))


def storage(shape: ShardShape, choice: TierChoice, opt: OptimizerCost) -> Storage:
    """Bytes per tier of a shard with a tier placement."""
    rec = (shape.dim + opt.state_width(shape.dim)) * 4.0
    if choice.tier is TierPlacement.SSD:
        return Storage(choice.device_rows * rec, choice.host_rows * rec, shape.rows * rec * SSD_OVERHEAD)
    return Storage(choice.device_rows * rec, choice.host_rows * rec, 0.0)


def perf(table: PlannerTable, sharding: ShardingType, shape: ShardShape, choice: TierChoice, topo: Topology,
         opt: OptimizerCost) -> Perf:
    """Seconds per step of one shard on its rank (see the module docstring)."""
    rec = (shape.dim + opt.state_width(shape.dim)) * 4.0
    row_bytes = shape.dim * 4.0
    U = distinct_rows(table, shape)
    if choice.tier is TierPlacement.DEVICE:
        hit_d, hit_h = 1.0, 1.0
    else:
        hit_d = hit_rate(table, choice.device_rows, shape.row_parts)
        hit_h = 1.0 if choice.tier is not TierPlacement.SSD else \
            hit_rate(table, choice.device_rows + choice.host_rows, shape.row_parts)
    if choice.tier is TierPlacement.HOST:
        read_bw = topo.host_bw
        hit_d, miss_move = 1.0, shape.ids * row_bytes / topo.device_host_bw  # gathered on host, copied up
    else:
        read_bw = topo.device_bw
        miss_move = 0.0
    compute = (shape.ids * row_bytes + shape.bags * row_bytes) / read_bw \
        + (shape.bags * row_bytes + 2.0 * U * rec) / read_bw + 2.0 * topo.call_overhead_s
    # misses: each missing access brings its record up and (training dirties it) one down
    dev_miss = (1.0 - hit_d) * shape.ids * rec * 2.0
    ssd_miss = (1.0 - hit_h) * shape.ids * rec * 2.0
    prefetch = miss_move + dev_miss / topo.device_host_bw + dev_miss / topo.host_bw + ssd_miss / topo.ssd_bw
    W = topo.world_size
    foreign = (W - 1) / W if W > 1 else 0.0
    bw = topo.all_to_all_bw
    if sharding is ShardingType.DATA_PARALLEL:
        ub = distinct_rows(table, shape)
        comm = (W - 1) * ub * (shape.dim * 4.0 + 8.0) / bw + 4 * topo.collective_latency_s
        # per-row gradients, then every rank applies every rank's rows (duplicates summed)
        compute += (2.0 * shape.ids * row_bytes + W * ub * (2.0 * rec + row_bytes)) / read_bw + topo.call_overhead_s
    else:
        comm = foreign * (shape.ids * 8.0 + 2.0 * shape.bags * row_bytes) / bw
        if sharding is ShardingType.COLUMN_WISE and opt.row_stat:
            comm += U * 4.0 / bw + topo.collective_latency_s  # the row statistic's all-reduce
            # per-row gradients summed outside the store (ids * d, read and written), one more call
            compute += (2.0 * shape.ids * row_bytes + U * rec) / read_bw + topo.call_overhead_s
    return Perf(compute, comm, prefetch)
