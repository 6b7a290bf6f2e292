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

from ..nn.features import SparseFeatures
from ..store.hierarchical import HierarchicalStore
from ..types import StoreConfig, TableSpec
from .dist import all_to_all
from .types import PlannerTable, ShardingPlan, Topology


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timeit(fn, reps: int, tries: int = 3) -> float:
    """Best of ``tries`` mean times of ``reps`` calls (overheads: the least-disturbed run)."""
    fn()
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def calibrate(world_size: int, ranks_per_host: int, optimizer, tmp: str | Path) -> Topology:
    """A :class:`Topology` measured on this group (call on every rank): store throughput
    with rows in the device tier (``device_bw``) and in the host tier (``host_bw``), call
    overhead, how many ranks run at once, collective latency and all-to-all bandwidth."""
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
        # the same work on rank 0 alone: how many ranks really run at once
        dist.barrier()
        alone = _timeit(big, 5) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        alone = _max_over_ranks(alone)
    # the same work with every row in the host tier (the device tier stages a batch)
    with HierarchicalStore([TableSpec("c", 200_000, dim)],
                           StoreConfig(Path(tmp) / f"calib-host{dist.get_rank()}", device_rows=1,
                                       host_rows=210_000, optimizer=optimizer)) as s:
        th = _max_over_ranks(_timeit(big, 5))
    rec = (dim + optimizer.state_width(dim)) * 4
    U = min(n, 200_000 * (1 - torch.exp(torch.tensor(-n / 200_000)).item()))
    charged = n * dim * 4 + 2 * bags * dim * 4 + 2 * U * rec
    bw = charged / max(tb - 2 * oh, 1e-6)
    # the cost model charges a host-tier shard ``charged / host_bw`` plus its ids' rows
    # copied up at ``device_host_bw`` (here ``bw``)
    host_bw = charged / max(th - 2 * oh - n * dim * 4 / bw, charged / bw / 4)
    tiny = torch.zeros(2 * world_size)
    lat = _max_over_ranks(_timeit(lambda: all_to_all(tiny, [2] * world_size, [2] * world_size), 50))
    m = 1 << 20
    big_buf = torch.zeros(m * world_size)
    ta = _max_over_ranks(_timeit(lambda: all_to_all(big_buf, [m] * world_size, [m] * world_size), 5))
    a2a_bw = (m * 4 * (world_size - 1)) / max(ta - lat, 1e-6)
    per_shard, step = _module_overheads(world_size, optimizer, Path(tmp))
    return Topology(world_size, ranks_per_host, device_bytes=1e10, host_bytes=1e10, ssd_bytes=1e11,
                    device_bw=bw, host_bw=min(bw, host_bw), device_host_bw=bw, ssd_bw=bw / 10, intra_host_bw=a2a_bw,
                    inter_host_bw=a2a_bw, call_overhead_s=max(oh, per_shard / 2), collective_latency_s=lat,
                    step_overhead_s=max(0.0, step - 4 * lat),
                    concurrency=min(float(world_size), max(1.0, world_size * alone / tb)))


def _module_overheads(world_size: int, optimizer, tmp: Path, k: int = 8) -> tuple[float, float]:
    """Per-shard and per-step fixed seconds of the sharded module: steps of 1 and of
    ``1 + k`` tiny table-wise tables on rank 0."""
    from .module import ShardedEmbeddingBagCollection
    from .types import ShardingType, ShardPlan, TablePlan

    def tiny(n: int) -> tuple[Workload, ShardingPlan]:
        w = Workload(tuple(PlannerTable(f"x{i}", 100, 8, 1.0) for i in range(n)), batch_size=4)
        p = ShardingPlan(world_size, world_size, tuple(
            TablePlan(t.name, ShardingType.TABLE_WISE, (ShardPlan(0, col_width=8, device_rows=100, host_rows=1),), 8)
            for t in w.tables))
        return w, p

    out = []
    for n in (1, 1 + k):
        w, p = tiny(n)
        out.append(time_plans([p], w, optimizer, steps=5, rounds=5, tmp=tmp / f"tiny{n}", reduce=min)[0])
    per_shard = max(0.0, (out[1] - out[0]) / k)
    return per_shard, max(0.0, out[0] - per_shard)


@dataclass(frozen=True)
class Workload:
    """Synthetic skewed batches for benchmarking plans (``id = rows * u**skew``, fixed seeds)."""

    tables: tuple[PlannerTable, ...]
    batch_size: int
    skew: float = 3.0
    seed: int = 0
    #: each table's skew from its ``zipf_alpha`` (``1 / (1 - alpha)``, alpha < 1) instead of ``skew``
    per_table_skew: bool = False

    def table_skew(self, t: PlannerTable) -> float:
        if self.per_table_skew and t.zipf_alpha < 1:
            return 1.0 / (1.0 - t.zipf_alpha)
        return self.skew

    def specs(self) -> tuple[TableSpec, ...]:
        return tuple(TableSpec(t.name, t.num_rows, t.dim) for t in self.tables)

    def batch(self, step: int, rank: int) -> SparseFeatures:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        vals, lens = [], []
        for t in self.tables:
            L = max(1, int(round(t.pooling_factor)))
            ln = torch.full((self.batch_size,), L, dtype=torch.int64)
            u = torch.rand(self.batch_size * L, generator=g)
            v = (t.num_rows * u ** self.table_skew(t)).long()  # low ids hot
            vals.append(v.clamp_(max=t.num_rows - 1))
            lens.append(ln)
        return SparseFeatures(tuple(t.name for t in self.tables), torch.cat(vals), torch.cat(lens))


def time_plans(plans: Sequence[ShardingPlan], work: Workload, optimizer, steps: int, rounds: int,
               tmp: str | Path | None = None, reduce=statistics.median,
               store_seconds: list | None = None) -> list[float]:
    """Step seconds (slowest rank; ``reduce`` over rounds, median by default) of each plan,
    plans interleaved ``rounds`` times.  ``store_seconds``, if given, receives per plan
    the per-round seconds per step spent inside the rank's store (lookups and fused
    updates; the most of any rank), the rest of a step being collectives, the split
    bookkeeping and waiting for the other ranks."""
    from .module import ShardedEmbeddingBagCollection

    tmp = Path(tmp or tempfile.mkdtemp(prefix="hiermem-bench-"))
    rank = dist.get_rank()
    mods = [ShardedEmbeddingBagCollection(work.specs(), p, StoreConfig(tmp / f"plan{i}", optimizer=optimizer))
            for i, p in enumerate(plans)]
    dims = sum(t.dim for t in work.tables)
    grad = torch.full((work.batch_size, dims), 1e-3)
    times: list[list[float]] = [[] for _ in plans]
    step = 0

    inside: list[list[float]] = [[] for _ in plans]

    def in_store(m) -> float:
        c = m.store.counters if m.store is not None else None
        return c.lookup_seconds.sum + c.update_seconds.sum if c is not None else 0.0

    def run(m, k: int, i: int | None = None) -> float:
        nonlocal step
        dist.barrier()
        s0 = in_store(m)
        t0 = time.perf_counter()
        for _ in range(k):
            out = m(work.batch(step, rank))
            out.backward(grad)
            step += 1
        dt = (time.perf_counter() - t0) / k
        if i is not None:
            inside[i].append(_max_over_ranks((in_store(m) - s0) / k))
        return _max_over_ranks(dt)

    for m in mods:  # warm-up: first touch of rows, allocator
        run(m, 2)
    for _ in range(rounds):
        for i, m in enumerate(mods):
            times[i].append(run(m, steps, i))
    if store_seconds is not None:
        store_seconds.extend(inside)
    for m in mods:
        m.close()
    return [reduce(t) for t in times]



#: ``id = rows * u**3`` has density ~ ``id**(-2/3)``: Zipf alpha 2/3.
_SKEW_ALPHA = 2.0 / 3.0

#: The workload of ``scripts/bench_shard.py`` and ``scripts/bench_plan.py``: one heavy
#: table (pooling 40), a wide one, a mid one and five small ones, 256 samples per rank.
BENCH_WORKLOAD = Workload((
    PlannerTable("heavy", 200_000, 64, 40.0, _SKEW_ALPHA),
    PlannerTable("wide", 50_000, 128, 4.0, _SKEW_ALPHA),
    PlannerTable("mid", 100_000, 32, 10.0, _SKEW_ALPHA),
    *(PlannerTable(f"small{i}", 5_000, 16, 2.0, _SKEW_ALPHA) for i in range(5)),
), batch_size=256)


def bench_worker(rank: int, world: int, out: str, names: Sequence[str], steps: int, rounds: int,
                 work: Workload = BENCH_WORKLOAD) -> None:
    """Calibrate, make the named plans (``planner`` or a :class:`ShardingType` value), time
    them; rank 0 writes ``out/result.json`` (measured and estimated ms per plan)."""
    import json

    from ..dataplane.optim import RowWiseAdagrad
    from .planner import estimate, naive_plan, plan, step_ms
    from .types import ShardingType

    opt = RowWiseAdagrad(lr=0.01)
    topo = calibrate(world, world, opt, out)
    tabs, B = work.tables, work.batch_size
    plans = {n: plan(tabs, topo, B, opt) if n == "planner" else naive_plan(tabs, topo, B, ShardingType(n), opt)
             for n in names}
    secs = time_plans(list(plans.values()), work, opt, steps, rounds, Path(out) / "stores")
    if rank == 0:
        res = {n: {"measured_ms": s * 1e3, "estimated_ms": step_ms(estimate(p, tabs, topo, B, opt), topo),
                   "shardings": {t.name: t.sharding.value for t in p.tables}}
               for (n, p), s in zip(plans.items(), secs)}
        Path(out, "result.json").write_text(json.dumps({"topology": topo.__dict__, "plans": res}))


def compare_worker(rank: int, world: int, out: str, work: Workload, budgets: tuple[float, float, float],
                   external: dict, steps: int, rounds: int, within: float = 2.0) -> None:
    """Calibrate, plan ``work`` under per-rank ``budgets`` (device, host, SSD bytes) with
    hiermem's planner and every
    feasible uniform sharding, add ``external`` plans (``{name: ShardingPlan JSON}``,
    e.g. TorchRec's translated plan), and time them interleaved; rank 0 writes
    ``out/result.json`` with per-round step times.

    Uniform plans whose estimate is over ``within`` times the best uniform estimate are
    reported (estimate only) but not timed.
    """
    import json
    from dataclasses import replace

    from ..dataplane.optim import RowWiseAdagrad
    from .planner import estimate, naive_plan, plan, step_ms
    from .types import PlannerError, ShardingType

    opt = RowWiseAdagrad(lr=0.01)
    cal = calibrate(world, world, opt, out)
    topo = replace(cal, device_bytes=float(budgets[0]), host_bytes=float(budgets[1]), ssd_bytes=float(budgets[2]))
    tabs, B = work.tables, work.batch_size
    plans = {"planner": plan(tabs, topo, B, opt)}
    uniform, infeasible = {}, {}
    for st in ShardingType:
        if st is ShardingType.TABLE_ROW_WISE and topo.ranks_per_host == world:
            continue  # one host: TWRW is RW
        try:
            uniform[f"all-{st.value}"] = naive_plan(tabs, topo, B, st, opt)
        except PlannerError as e:
            infeasible[f"all-{st.value}"] = str(e)
    best = min(p.estimated_ms for p in uniform.values())
    untimed = {n: p for n, p in uniform.items() if p.estimated_ms > within * best}
    plans.update({n: p for n, p in uniform.items() if n not in untimed})
    from .types import ShardingPlan

    plans.update({n: ShardingPlan.from_json(js) for n, js in external.items()})
    inside: list = []
    secs = time_plans(list(plans.values()), work, opt, steps, rounds, Path(out) / "stores", reduce=list,
                      store_seconds=inside)
    if rank == 0:
        def info(p):
            return {"estimated_ms": step_ms(estimate(p, tabs, topo, B, opt), topo),
                    "estimated_parts_ms": _parts_ms(p, tabs, topo, B, opt),
                    "shardings": {t.name: t.sharding.value for t in p.tables},
                    "tiers": {t.name: sorted({s.tier.value for s in t.shards}) for t in p.tables},
                    "ranks": {t.name: [s.rank for s in t.shards] for t in p.tables},
                    "rank_bytes": p.rank_bytes()}
        res = {n: {"rounds_ms": [x * 1e3 for x in t], "store_ms": statistics.median(x) * 1e3, **info(p)}
               for (n, p), t, x in zip(plans.items(), secs, inside)}
        res.update({n: {"rounds_ms": None, **info(p)} for n, p in untimed.items()})
        Path(out, "result.json").write_text(json.dumps({"topology": topo.__dict__, "plans": res,
                                                        "infeasible": infeasible}))


def _parts_ms(p: ShardingPlan, tables, topo: Topology, batch: int, optimizer) -> dict[str, float]:
    """The cost model's compute / comm / prefetch ms of a plan, summed over its shards."""
    from .cost import OptimizerCost, TierChoice, perf, shard_shape

    opt = OptimizerCost.of(optimizer)
    tabs = {t.name: t for t in tables}
    tot = {"compute": 0.0, "comm": 0.0, "prefetch": 0.0}
    for tp in p.tables:
        t = tabs[tp.name]
        for s in tp.shards:
            shape = shard_shape(t, tp.sharding, topo, batch, s.row_parts, s.col_width or t.dim)
            q = perf(t, tp.sharding, shape, TierChoice(s.tier, s.device_rows, s.host_rows), topo, opt)
            tot = {"compute": tot["compute"] + q.compute * 1e3, "comm": tot["comm"] + q.comm * 1e3,
                   "prefetch": tot["prefetch"] + q.prefetch * 1e3}
    return tot
