"""The planner: enumerate options -> estimate once -> greedy LPT search -> ShardingPlan.

Stages (cf. TorchRec's planner), each a small protocol over frozen values, composed by
:func:`plan`:

1. :class:`Enumerator` (default :class:`RuleEnumerator`): per table, the shapes every
   allowed sharding's rule offers (:mod:`.rules`: TW, RW, CW with 2/4/8 column shards,
   DP, TWRW) -- :class:`~hiermem.sharding.rules.Shape` values.
2. :class:`Estimator` (default :class:`CostEstimator`): per shape, every tier placement
   the tier rules offer (all device; device cache of ``c`` over host for a grid of
   ``c``; host-resident; SSD with device+host caches), each costed once by
   :mod:`hiermem.sharding.cost`, then pruned to the knee of its time/memory frontier (a
   bigger cache must buy >= 1%) -- an :class:`Option` with its :class:`Candidates`.
3. :class:`Search` (default :class:`GreedySearch`): greedy longest-processing-time-first:
   tables in decreasing order of cost; each takes the option and ranks (chosen by its
   sharding's rule) that minimise the slowest rank's estimated step time (ties: the
   least total added time) among those that fit every rank's remaining device/host/SSD
   budget.  No option fits: :class:`PlannerError` naming the table and the shortfall.

Adding a sharding type or a tier is one rule in :mod:`.rules` (and its cost in
:mod:`.cost`); nothing here branches on the type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

import numpy as np

from .cost import OptimizerCost, ShardShape, TierChoice, distinct_rows, perf, shard_shape, storage
from .rules import CW_SPLITS, MIN_CW_DIM, SHARDING_RULES, TIER_RULES, Shape  # noqa: F401 (re-exported)
from .types import (PlannerError, PlannerErrorKind, PlannerTable, ShardingPlan, ShardingType, ShardPlan, TablePlan,
                    Topology)

ALL_SHARDINGS = tuple(ShardingType)
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


class Enumerator(Protocol):
    """Stage 1: the shapes a table may take."""

    def __call__(self, table: PlannerTable, topo: Topology, batch: int,
                 allowed: Sequence[ShardingType]) -> list[Shape]: ...


class Estimator(Protocol):
    """Stage 2: a shape's costed tier candidates."""

    def __call__(self, table: PlannerTable, shape: Shape, topo: Topology, opt: OptimizerCost) -> Option: ...


class Search(Protocol):
    """Stage 3: a plan from every table's options."""

    def __call__(self, tables: Sequence[PlannerTable], options: Mapping[str, list[Option]], topo: Topology,
                 base_s: float) -> tuple[dict[str, TablePlan], np.ndarray]: ...


def tier_candidates(table: PlannerTable, sharding: ShardingType, shape: ShardShape, topo: Topology,
                    opt: OptimizerCost, tiers: Sequence = TIER_RULES) -> Candidates:
    """Every tier placement of one shard (from the ``tiers`` rules), costed and knee-pruned."""
    choices = [c for rule in tiers for c in rule.choices(shape)]
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


class RuleEnumerator:
    """Every allowed sharding's shapes, from :data:`~hiermem.sharding.rules.SHARDING_RULES`."""

    def __call__(self, table, topo, batch, allowed):
        return [sh for st in allowed for sh in SHARDING_RULES[st].shapes(table, topo, batch, allowed)]


@dataclass(frozen=True)
class CostEstimator:
    """Tier candidates of a shape from the ``tiers`` rules, costed by :mod:`.cost`, knee-pruned."""

    tiers: tuple = TIER_RULES

    def __call__(self, table, shape, topo, opt):
        return Option(shape.sharding, shape.nshards, shape.widths,
                      tier_candidates(table, shape.sharding, shape.shape, topo, opt, self.tiers))


def enumerate_options(table: PlannerTable, topo: Topology, batch: int, opt: OptimizerCost,
                      allowed: Sequence[ShardingType] = ALL_SHARDINGS, enumerator: Optional[Enumerator] = None,
                      estimator: Optional[Estimator] = None) -> list[Option]:
    """The sharding options of one table, with their costed tier candidates (stages 1-2)."""
    est = estimator or CostEstimator()
    return [est(table, sh, topo, opt) for sh in (enumerator or RuleEnumerator())(table, topo, batch, allowed)]


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
    ranks = SHARDING_RULES[o.sharding].ranks(o.nshards, secs, new, st.load.max(), topo)
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
    for o in options:
        small = o.cands.nbytes.sum(1).argmin()
        deficit = np.maximum(o.cands.nbytes[small][None, :] - st.rem, 0.0)  # [W, 3]
        cand, tier = SHARDING_RULES[o.sharding].shortfall(deficit, o.nshards)
        if cand < best:
            best, where = cand, f"{o.sharding.value} ({tier})"
    return PlannerError(f"table {t.name} does not fit: even its smallest option, {where}, is {best:.4g} bytes "
                        f"over the budgets left", PlannerErrorKind.INSUFFICIENT_MEMORY, t.name, best)


def _table_plan(t: PlannerTable, o: Option, ranks: list[int], idx: np.ndarray) -> TablePlan:
    rule = SHARDING_RULES[o.sharding]
    shards = []
    for k, r in enumerate(ranks):
        j = int(idx[r])
        ch, b = o.cands.choices[j], o.cands.nbytes[j]
        lay = rule.layout(k, len(ranks), o.widths, t.dim)
        shards.append(ShardPlan(r, lay.row_part, lay.row_parts, lay.col_start, lay.width, ch.tier,
                                int(ch.device_rows), int(ch.host_rows), float(o.cands.seconds[j]) * 1e3,
                                float(b[0]), float(b[1]), float(b[2])))
    return TablePlan(t.name, o.sharding, tuple(shards), t.dim)


class GreedySearch:
    """Longest-processing-time-first: costliest tables first, each where the makespan
    bound grows least (see :func:`_place`); returns the tables' plans and rank loads."""

    def __call__(self, tables, options, topo, base_s):
        W = topo.world_size
        st = _State(np.full(W, base_s), np.tile([topo.device_bytes, topo.host_bytes, topo.ssd_bytes], (W, 1))
                    .astype(float))

        def least(t: PlannerTable) -> float:
            return min(float(o.cands.seconds[0]) * o.nshards for o in options[t.name])

        order = sorted(tables, key=lambda t: (-least(t), -t.num_rows * t.dim))
        mins = [least(t) for t in order]
        rest = float(np.sum(mins))
        chosen: dict[str, TablePlan] = {}
        for t, mine in zip(order, mins):
            rest -= mine
            best = None
            for o in options[t.name]:
                got = _place(o, st, topo, max(rest, 0.0))
                if got is not None and (best is None or _better(got[0], best[0][0])):
                    best = (got, o)
            if best is None:
                raise _shortfall(t, options[t.name], st)
            (score, ranks, idx), o = best
            tp = _table_plan(t, o, ranks, idx)
            for s in tp.shards:
                st.load[s.rank] += s.est_ms / 1e3
                st.rem[s.rank] -= (s.device_bytes, s.host_bytes, s.ssd_bytes)
            chosen[t.name] = tp
        return chosen, st.load


def _as_table(t) -> PlannerTable:
    if isinstance(t, PlannerTable):
        return t
    from ..types import TableSpec

    if isinstance(t, TableSpec):
        return PlannerTable.from_spec(t)
    raise PlannerError(f"tables must be PlannerTable or TableSpec, got {type(t).__name__}", PlannerErrorKind.BAD_INPUT)


def plan(tables: Sequence, topology: Topology, batch_size: int, optimizer=None,
         allowed: Optional[Mapping[str, Sequence[ShardingType]] | Sequence[ShardingType]] = None,
         enumerator: Optional[Enumerator] = None, estimator: Optional[Estimator] = None,
         search: Optional[Search] = None) -> ShardingPlan:
    """Plan ``tables`` over ``topology`` for ``batch_size`` samples per rank and step.

    Args:
        tables: :class:`PlannerTable` (or bounded :class:`~hiermem.TableSpec`) per table.
        topology: ranks, budgets, bandwidths.
        batch_size: samples per rank per step.
        optimizer: a :class:`~hiermem.Optimizer` (its state size; default ``SGD``).
        allowed: shardings to consider, for all tables or per table name (default: all).
        enumerator, estimator, search: replace a stage (defaults: :class:`RuleEnumerator`,
            :class:`CostEstimator`, :class:`GreedySearch`).

    Returns:
        A frozen :class:`ShardingPlan` in the tables' order.

    Raises:
        PlannerError: a table fits no rank's remaining budgets (names table and
            shortfall), or bad input.
    """
    from ..dataplane.optim import SGD

    tabs = [_as_table(t) for t in tables]
    if not tabs:
        raise PlannerError("no tables to plan", PlannerErrorKind.BAD_INPUT)
    if len({t.name for t in tabs}) != len(tabs):
        raise PlannerError("duplicate table names", PlannerErrorKind.BAD_INPUT)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise PlannerError(f"batch_size must be a positive int, got {batch_size!r}", PlannerErrorKind.BAD_INPUT)
    opt = OptimizerCost.of(optimizer if optimizer is not None else SGD())
    base = STEP_COLLECTIVES * topology.collective_latency_s + topology.step_overhead_s

    def allowed_for(name: str) -> Sequence[ShardingType]:
        if allowed is None:
            return ALL_SHARDINGS
        if isinstance(allowed, Mapping):
            return tuple(allowed.get(name, ALL_SHARDINGS))
        return tuple(allowed)

    enum, est = enumerator or RuleEnumerator(), estimator or CostEstimator()
    options = {t.name: enumerate_options(t, topology, batch_size, opt, allowed_for(t.name), enum, est)
               for t in tabs}
    for t in tabs:
        if not options[t.name]:
            raise PlannerError(f"table {t.name}: no allowed sharding applies", PlannerErrorKind.BAD_INPUT, t.name)
    chosen, load = (search or GreedySearch())(tabs, options, topology, base)
    return ShardingPlan(topology.world_size, topology.ranks_per_host, tuple(chosen[t.name] for t in tabs),
                        tuple(float(x) * 1e3 for x in load),
                        {"batch_size": batch_size, "optimizer": (optimizer or SGD()).name,
                         "step_ms": step_ms(load * 1e3, topology)})


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
    from ..dataplane.optim import SGD

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


__all__ = ["ALL_SHARDINGS", "Candidates", "CostEstimator", "Enumerator", "Estimator", "GreedySearch", "Option",
           "RuleEnumerator", "Search", "distinct_rows", "enumerate_options", "estimate", "naive_plan", "plan",
           "step_ms", "tier_candidates"]
