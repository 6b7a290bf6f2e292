"""Measure this machine's cost-model constants, and time sharding plans, on a live group.

:func:`calibrate` runs inside every rank of an initialised process group and returns a
:class:`Topology` whose bandwidths and overheads were measured in that run (store
lookup+update throughput and per-call overhead, collective latency, all-to-all
bandwidth), so estimates and measurements of the same run can be compared.
:func:`time_plans` trains each plan for some steps, interleaving the plans so that
machine noise hits them alike, and returns the median step time of the slowest rank.
Used by ``scripts/bench_shard.py`` and ``scripts/bench_plan.py``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ..features import SparseFeatures
from ..store import HierarchicalStore
from ..types import StoreConfig, TableSpec
from .dist import all_to_all
from .types import PlannerTable, ShardingPlan, Topology


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timeit(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def calibrate(world_size: int, ranks_per_host: int, optimizer, tmp: str | Path) -> Topology:
    """A :class:`Topology` measured on this group (call on every rank)."""
    path = Path(tmp) / f"calib{dist.get_rank()}"
    dim, n = 64, 40_000
    with HierarchicalStore([TableSpec("c", 200_000, dim)],
                           StoreConfig(path, device_rows=210_000, host_rows=1000, optimizer=optimizer)) as s:
        one, o1 = torch.tensor([3]), torch.tensor([0])
        g1 = torch.zeros(1, dim)

        def small():
            s.lookup_pooled("c", one, o1)
            s.update_pooled("c", one, o1, g1)

        ids = torch.randint(0, 200_000, (n,))
        bags = n // 20
        off = torch.arange(bags) * 20
        gb = torch.zeros(bags, dim)

        def big():
            s.lookup_pooled("c", ids, off)
            s.update_pooled("c", ids, off, gb)

        oh = _max_over_ranks(_timeit(small, 50)) / 2
        tb = _max_over_ranks(_timeit(big, 5))
    rec = (dim + optimizer.state_width(dim)) * 4
    U = min(n, 200_000 * (1 - torch.exp(torch.tensor(-n / 200_000)).item()))
    charged = n * dim * 4 + 2 * bags * dim * 4 + 2 * U * rec
    bw = charged / max(tb - 2 * oh, 1e-6)
    tiny = torch.zeros(2 * world_size)
    lat = _max_over_ranks(_timeit(lambda: all_to_all(tiny, [2] * world_size, [2] * world_size), 50))
    m = 1 << 20
    big_buf = torch.zeros(m * world_size)
    ta = _max_over_ranks(_timeit(lambda: all_to_all(big_buf, [m] * world_size, [m] * world_size), 5))
    a2a_bw = (m * 4 * (world_size - 1)) / max(ta - lat, 1e-6)
    return Topology(world_size, ranks_per_host, device_bytes=1e10, host_bytes=1e10, ssd_bytes=1e11,
                    device_bw=bw, host_bw=bw, device_host_bw=bw, ssd_bw=bw / 10, intra_host_bw=a2a_bw,
                    inter_host_bw=a2a_bw, call_overhead_s=oh, collective_latency_s=lat)


@dataclass(frozen=True)
class Workload:
    """Synthetic skewed batches for benchmarking plans (``id = rows * u**skew``, fixed seeds)."""

    tables: tuple[PlannerTable, ...]
    batch_size: int
    skew: float = 3.0
    seed: int = 0

    def specs(self) -> tuple[TableSpec, ...]:
        return tuple(TableSpec(t.name, t.num_rows, t.dim) for t in self.tables)

    def batch(self, step: int, rank: int) -> SparseFeatures:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        vals, lens = [], []
        for t in self.tables:
            L = max(1, int(round(t.pooling_factor)))
            ln = torch.full((self.batch_size,), L, dtype=torch.int64)
            u = torch.rand(self.batch_size * L, generator=g)
            v = (t.num_rows * u ** self.skew).long()  # low ids hot
            vals.append(v.clamp_(max=t.num_rows - 1))
            lens.append(ln)
        return SparseFeatures(tuple(t.name for t in self.tables), torch.cat(vals), torch.cat(lens))


def time_plans(plans: Sequence[ShardingPlan], work: Workload, optimizer, steps: int, rounds: int,
               tmp: str | Path | None = None) -> list[float]:
    """Median step seconds (slowest rank) of each plan, plans interleaved ``rounds`` times."""
    from .module import ShardedEmbeddingBagCollection

    tmp = Path(tmp or tempfile.mkdtemp(prefix="hiermem-bench-"))
    rank = dist.get_rank()
    mods = [ShardedEmbeddingBagCollection(work.specs(), p, StoreConfig(tmp / f"plan{i}", optimizer=optimizer))
            for i, p in enumerate(plans)]
    dims = sum(t.dim for t in work.tables)
    grad = torch.full((work.batch_size, dims), 1e-3)
    times: list[list[float]] = [[] for _ in plans]
    step = 0

    def run(m, k: int) -> float:
        nonlocal step
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            out = m(work.batch(step, rank))
            out.backward(grad)
            step += 1
        return _max_over_ranks((time.perf_counter() - t0) / k)

    for m in mods:  # warm-up: first touch of rows, allocator
        run(m, 2)
    for _ in range(rounds):
        for i, m in enumerate(mods):
            times[i].append(run(m, steps))
    for m in mods:
        m.close()
    return [statistics.median(t) for t in times]

