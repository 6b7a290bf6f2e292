"""The planner: enumerate options -> estimate once -> greedy LPT search -> ShardingPlan.

Stages (cf. TorchRec's planner), each a small function over frozen values:

1. :func:`enumerate_options`: per table, the shardings it allows (TW, RW, CW with 2/4/8
   column shards, DP, TWRW) and, per shard, tier placements (all device; device cache
   of ``c`` over host for a grid of ``c``; host-resident; SSD with device+host caches).
2. estimation: every candidate is costed once by :mod:`hiermem.sharding.cost`, then
   pruned to the knee of its time/memory frontier (a bigger cache must buy >= 1%).
3. :func:`plan`: greedy longest-processing-time-first: tables in decreasing order of
   cost; each takes the option and ranks that minimise the slowest rank's estimated
   step time (ties: the least total added time) among those that fit every rank's
   remaining device/host/SSD budget.  No option fits: :class:`PlannerError` naming the
   table and the shortfall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from .cost import OptimizerCost, ShardShape, TierChoice, distinct_rows, perf, shard_shape, storage
from .types import (PlannerError, PlannerErrorKind, PlannerTable, ShardingPlan, ShardingType, ShardPlan,
                    TablePlan, TierPlacement, Topology)

ALL_SHARDINGS = tuple(ShardingType)
#: Column shards of a CW option (each at least :data:`MIN_CW_DIM` wide).
CW_SPLITS = (2, 4, 8)
MIN_CW_DIM = 4
#: A larger cache must cut a shard's estimated time by this fraction to stay a candidate.
KNEE = 0.01
#: Collectives of every step whatever the plan (header, ids, pooled rows, gradients).
STEP_COLLECTIVES = 4


@dataclass(frozen=True)
class Candidates:
    """Tier placements of one shard shape, sorted by time: choices, seconds, bytes [K, 3]."""

    choices: tuple[TierChoice, ...]
    seconds: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True)
class Option:
    """One way to shard a table: ``shards`` column widths (or row parts) and candidates."""

    sharding: ShardingType
    nshards: int
    widths: tuple[int, ...]  # column width of each shard (all == dim unless CW)
    cands: Candidates


def _grid(rows: int, lo: int = 1) -> list[int]:
    out, c = [], rows // 2
    while c >= max(1, lo) and len(out) < 12:
        out.append(c)
        c //= 4
    return out


def tier_candidates(table: PlannerTable, sharding: ShardingType, shape: ShardShape, topo: Topology,
                    opt: OptimizerCost) -> Candidates:
    """Every tier placement of one shard, costed and knee-pruned."""
    n = shape.rows
    need = int(math.ceil(min(float(n), shape.ids)))  # a batch's rows must be resident at once
    choices = [TierChoice(TierPlacement.DEVICE, n, 1), TierChoice(TierPlacement.HOST, 1, n)]
    choices += [TierChoice(TierPlacement.CACHED, c, n - c) for c in _grid(n)]
    for cd in _grid(n):
        for ch in (_grid(n) or [1])[::2]:
            if cd + ch >= need and cd + ch < n:
                choices.append(TierChoice(TierPlacement.SSD, cd, ch))
    secs = np.array([perf(table, sharding, shape, c, topo, opt).total for c in choices])
    nb = np.array([[s.device, s.host, s.ssd] for s in (storage(shape, c, opt) for c in choices)])
    keep = []
    for j in range(len(choices)):  # drop j when some other is no bigger anywhere and within KNEE
        le = (nb <= nb[j]).all(1) & (secs <= secs[j] * (1 + KNEE))
        le[j] = False
        same = (nb == nb[j]).all(1) & (secs == secs[j])
        if not (le & ~(same & (np.arange(len(choices)) > j))).any():
            keep.append(j)
    order = sorted(keep, key=lambda j: (secs[j], nb[j, 0]))
    return Candidates(tuple(choices[j] for j in order), secs[order], nb[order])


def _cw_widths(dim: int, k: int) -> tuple[int, ...]:
    base, extra = divmod(dim, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


def enumerate_options(table: PlannerTable, topo: Topology, batch: int, opt: OptimizerCost,
                      allowed: Sequence[ShardingType] = ALL_SHARDINGS) -> list[Option]:
    """The sharding options of one table, with their costed tier candidates."""
    W, H = topo.world_size, topo.ranks_per_host
    out = []
    for st in allowed:
        if st is ShardingType.TABLE_WISE or st is ShardingType.DATA_PARALLEL:
            n, widths = (1 if st is ShardingType.TABLE_WISE else W), (table.dim,)
            out.append(Option(st, n, widths * n, tier_candidates(table, st, shard_shape(table, st, topo, batch),
                                                                 topo, opt)))
        elif st is ShardingType.ROW_WISE or st is ShardingType.TABLE_ROW_WISE:
            parts = W if st is ShardingType.ROW_WISE else H
            if st is ShardingType.TABLE_ROW_WISE and H == W and ShardingType.ROW_WISE in allowed:
                continue  # one host: TWRW is RW
            shape = shard_shape(table, st, topo, batch, parts)
            out.append(Option(st, parts, (table.dim,) * parts, tier_candidates(table, st, shape, topo, opt)))
        else:
            for k in CW_SPLITS:
                if k > W or table.dim // k < MIN_CW_DIM:
                    continue
                widths = _cw_widths(table.dim, k)
                shape = shard_shape(table, st, topo, batch, dim=widths[0])
                out.append(Option(st, k, widths, tier_candidates(table, st, shape, topo, opt)))
    return out


@dataclass
class _State:
    """The search's running totals (mutable, private to :func:`plan`)."""

    load: np.ndarray  # [W] seconds
    rem: np.ndarray  # [W, 3] bytes left per tier


def _best_per_rank(c: Candidates, rem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: seconds of the fastest candidate that fits (inf: none) and its index."""
    fits = (c.nbytes[None, :, :] <= rem[:, None, :]).all(2)  # [W, K]
    idx = np.where(fits.any(1), fits.argmax(1), -1)
    secs = np.where(idx >= 0, c.seconds[np.maximum(idx, 0)], np.inf)
    return secs, idx


def _place(o: Option, st: _State, topo: Topology, rest: float) -> Optional[tuple[tuple, list[int], np.ndarray]]:
    """The best ranks for option ``o``: (score, ranks, candidate index per rank) or None.

    The score is the makespan bound ``max(slowest rank, (all work so far + this option +
    the least work of the tables still to place) / W)``, then the added time: early on
    the remaining work dominates and options that add the least total time win; a table
    whose shard would stick out above the average is spread instead.
    """
    secs, idx = _best_per_rank(o.cands, st.rem)
    new = st.load + secs
    cur = st.load.max()
    if o.sharding is ShardingType.TABLE_WISE:
        r = int(np.lexsort((new, np.maximum(new, cur)))[0])
        ranks = [r]
    elif o.sharding is ShardingType.COLUMN_WISE:
        order = np.argsort(new, kind="stable")[: o.nshards]
        ranks = sorted(int(r) for r in order)
    elif o.sharding is ShardingType.TABLE_ROW_WISE:
        hosts = [list(topo.host_ranks(h)) for h in range(topo.num_hosts)]
        ranks = min(hosts, key=lambda rs: (new[rs].max(), secs[rs].sum()))
    else:
        ranks = list(range(topo.world_size))
    if not np.isfinite(secs[ranks]).all():
        return None
    loads = st.load.copy()
    loads[ranks] += secs[ranks]
    added = float(secs[ranks].sum())
    bound = (float(st.load.sum()) + added + rest) / topo.parallel_ranks
    return (max(float(loads.max()), bound), added), ranks, idx


#: Makespan bounds within this fraction count as a tie (then the least added time wins:
#: spreading a table must buy a clear gain, since its extra shards cost more than modelled).
TIE = 0.05


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Score ``a`` (slowest rank, added time) beats ``b``."""
    if a[0] < b[0] * (1 - TIE):
        return True
    return a[0] <= b[0] * (1 + TIE) and a[1] < b[1]


def _shortfall(t: PlannerTable, options: list[Option], st: _State) -> PlannerError:
    best, where = math.inf, ""
    names = ("device", "host", "ssd")
    for o in options:
        small = o.cands.nbytes.sum(1).argmin()
        need = o.cands.nbytes[small]
        deficit = np.maximum(need[None, :] - st.rem, 0.0)  # [W, 3]
        if o.sharding is ShardingType.TABLE_WISE:
            per = deficit.sum(1)
            r = int(per.argmin())
            cand, tier = float(per[r]), names[int(deficit[r].argmax())]
        else:
            per = np.sort(deficit.sum(1))[: o.nshards] if o.sharding is ShardingType.COLUMN_WISE else deficit.sum(1)
            cand, tier = float(per.max()) * 1.0, names[int(deficit.sum(0).argmax())]
        if cand < best:
            best, where = cand, f"{o.sharding.value} ({tier})"
    return PlannerError(f"table {t.name} does not fit: even its smallest option, {where}, is {best:.4g} bytes "
                        f"over the budgets left", PlannerErrorKind.INSUFFICIENT_MEMORY, t.name, best)


def _table_plan(t: PlannerTable, o: Option, ranks: list[int], idx: np.ndarray, topo: Topology) -> TablePlan:
    shards, col = [], 0
    for k, r in enumerate(ranks):
        j = int(idx[r])
        ch = o.cands.choices[j]
        b = o.cands.nbytes[j]
        row_part, row_parts, c0, w = 0, 1, 0, t.dim
        if o.sharding in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            row_part, row_parts = k, len(ranks)
        elif o.sharding is ShardingType.COLUMN_WISE:
            c0, w = col, o.widths[k]
            col += w
        shards.append(ShardPlan(r, row_part, row_parts, c0, w, ch.tier, int(ch.device_rows), int(ch.host_rows),
                                float(o.cands.seconds[j]) * 1e3, float(b[0]), float(b[1]), float(b[2])))
    return TablePlan(t.name, o.sharding, tuple(shards), t.dim)


def _as_table(t) -> PlannerTable:
    if isinstance(t, PlannerTable):
        return t
    from ..types import TableSpec

    if isinstance(t, TableSpec):
        return PlannerTable.from_spec(t)
    raise PlannerError(f"tables must be PlannerTable or TableSpec, got {type(t).__name__}", PlannerErrorKind.BAD_INPUT)


def plan(tables: Sequence, topology: Topology, batch_size: int, optimizer=None,
         allowed: Optional[Mapping[str, Sequence[ShardingType]] | Sequence[ShardingType]] = None) -> ShardingPlan:
    """Plan ``tables`` over ``topology`` for ``batch_size`` samples per rank and step.

    Args:
        tables: :class:`PlannerTable` (or bounded :class:`~hiermem.TableSpec`) per table.
        topology: ranks, budgets, bandwidths.
        batch_size: samples per rank per step.
        optimizer: a :class:`~hiermem.Optimizer` (its state size; default ``SGD``).
        allowed: shardings to consider, for all tables or per table name (default: all).

    Returns:
        A frozen :class:`ShardingPlan` in the tables' order.

    Raises:
        PlannerError: a table fits no rank's remaining budgets (names table and
            shortfall), or bad input.
    """
    from ..optim import SGD

    tabs = [_as_table(t) for t in tables]
    if not tabs:
        raise PlannerError("no tables to plan", PlannerErrorKind.BAD_INPUT)
    if len({t.name for t in tabs}) != len(tabs):
        raise PlannerError("duplicate table names", PlannerErrorKind.BAD_INPUT)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise PlannerError(f"batch_size must be a positive int, got {batch_size!r}", PlannerErrorKind.BAD_INPUT)
    opt = OptimizerCost.of(optimizer if optimizer is not None else SGD())
    W = topology.world_size
    base = STEP_COLLECTIVES * topology.collective_latency_s + topology.step_overhead_s
    st = _State(np.full(W, base), np.tile([topology.device_bytes, topology.host_bytes, topology.ssd_bytes], (W, 1))
                .astype(float))

    def allowed_for(name: str) -> Sequence[ShardingType]:
        if allowed is None:
            return ALL_SHARDINGS
        if isinstance(allowed, Mapping):
            return tuple(allowed.get(name, ALL_SHARDINGS))
        return tuple(allowed)

    options = {t.name: enumerate_options(t, topology, batch_size, opt, allowed_for(t.name)) for t in tabs}
    for t in tabs:
        if not options[t.name]:
            raise PlannerError(f"table {t.name}: no allowed sharding applies", PlannerErrorKind.BAD_INPUT, t.name)

    def size(t: PlannerTable) -> tuple:
        tw = [o for o in options[t.name]]
        return (-min(float(o.cands.seconds[0]) * o.nshards for o in tw), -t.num_rows * t.dim)

    order = sorted(tabs, key=size)
    least = [min(float(o.cands.seconds[0]) * o.nshards for o in options[t.name]) for t in order]
    rest = float(np.sum(least))
    chosen: dict[str, TablePlan] = {}
    for t, mine in zip(order, least):
        rest -= mine
        best = None
        for o in options[t.name]:
            got = _place(o, st, topology, max(rest, 0.0))
            if got is not None and (best is None or _better(got[0], best[0][0])):
                best = (got, o)
        if best is None:
            raise _shortfall(t, options[t.name], st)
        (score, ranks, idx), o = best
        tp = _table_plan(t, o, ranks, idx, topology)
        for s in tp.shards:
            st.load[s.rank] += s.est_ms / 1e3
            st.rem[s.rank] -= (s.device_bytes, s.host_bytes, s.ssd_bytes)
        chosen[t.name] = tp
    return ShardingPlan(W, topology.ranks_per_host, tuple(chosen[t.name] for t in tabs),
                        tuple(float(x) * 1e3 for x in st.load),
                        {"batch_size": batch_size, "optimizer": (optimizer or SGD()).name,
                         "step_ms": step_ms(st.load * 1e3, topology)})


def step_ms(rank_ms, topology: Topology) -> float:
    """A step's estimate from per-rank ms: the slowest rank, or the total work over the
    ranks that truly run at once (:attr:`Topology.parallel_ranks`) when that is more."""
    rank_ms = np.asarray(rank_ms, dtype=float)
    return float(max(rank_ms.max(), rank_ms.sum() / topology.parallel_ranks))


def naive_plan(tables: Sequence, topology: Topology, batch_size: int, sharding: ShardingType,
               optimizer=None) -> ShardingPlan:
    """Every table sharded the same way (tier placement and ranks still chosen by cost)."""
    return plan(tables, topology, batch_size, optimizer, allowed=(sharding,))


def estimate(p: ShardingPlan, tables: Sequence, topology: Topology, batch_size: int, optimizer=None) -> list[float]:
    """The cost model's per-rank step time (ms) of an existing plan, e.g. a hand-made one."""
    from ..optim import SGD

    opt = OptimizerCost.of(optimizer if optimizer is not None else SGD())
    tabs = {t.name: t for t in (_as_table(x) for x in tables)}
    load = np.full(topology.world_size, STEP_COLLECTIVES * topology.collective_latency_s + topology.step_overhead_s)
    for tp in p.tables:
        t = tabs[tp.name]
        for s in tp.shards:
            shape = shard_shape(t, tp.sharding, topology, batch_size, s.row_parts, s.col_width or t.dim)
            ch = TierChoice(s.tier, s.device_rows, s.host_rows)
            load[s.rank] += perf(t, tp.sharding, shape, ch, topology, opt).total
    return [float(x) * 1e3 for x in load]


__all__ = ["ALL_SHARDINGS", "Candidates", "Option", "distinct_rows", "enumerate_options", "estimate", "naive_plan",
           "plan", "step_ms", "tier_candidates"]
