"""TorchRec's planner on hiermem's tables: run ``EmbeddingShardingPlanner``, translate its plan.

:func:`torchrec_plan` gives TorchRec's ``EmbeddingShardingPlanner`` the same tables
(rows, dim, pooling factor), the same world size and the same per-rank budget, and
translates its answer with :func:`translate` into a hiermem :class:`ShardingPlan` that
:class:`~hiermem.sharding.ShardedEmbeddingBagCollection` executes, so both planners'
plans run on one executor and can be timed side by side.

Translation, per table:

* ``table_wise`` -> TW on its rank; ``column_wise`` / ``table_column_wise`` -> CW with
  TorchRec's column offsets and widths on its ranks; ``data_parallel`` -> DP;
  ``row_wise`` -> RW and ``table_row_wise`` -> TWRW over the same ranks.  TorchRec
  splits rows into contiguous blocks, hiermem by ``id % parts``: same number of parts
  on the same ranks, same bytes per rank up to rounding.
* compute kernel ``dense`` / ``fused`` (rows in the memory the lookup reads) -> the
  ``DEVICE`` tier; ``fused_uvm_caching`` (a cache over host memory) -> ``CACHED`` with
  TorchRec's cache rows; ``fused_uvm`` -> ``HOST``.  Other kernels (quantised, key-value,
  virtual tables) are refused.

On a CPU topology TorchRec keeps every table in the ranks' DDR (``ddr_cap``) and has no
cached tier, so it gets all the memory of a hiermem rank, ``device_bytes + host_bytes``,
and :func:`translate` puts its tables in hiermem's fastest tier (``DEVICE``), which may
exceed hiermem's device budget.  :func:`fit_tiers` makes that plan respect the same
budgets hiermem's planner had: TorchRec's shardings, ranks and column splits stay, and
each shard takes the fastest tier placement (hiermem's tier rules and cost model) that
fits its rank's remaining device / host / SSD budget, costliest shards first -- the
best tiering TorchRec's sharding can get.  torchrec is imported only here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from ..errors import InvalidArgumentError
from .cost import OptimizerCost, TierChoice, shard_shape, storage
from .planner import MIN_CW_DIM
from .types import PlannerTable, ShardingPlan, ShardingType, ShardPlan, TablePlan, TierPlacement, Topology

#: TorchRec sharding type value -> hiermem's.
SHARDING = {
    "table_wise": ShardingType.TABLE_WISE,
    "row_wise": ShardingType.ROW_WISE,
    "column_wise": ShardingType.COLUMN_WISE,
    "table_column_wise": ShardingType.COLUMN_WISE,
    "data_parallel": ShardingType.DATA_PARALLEL,
    "table_row_wise": ShardingType.TABLE_ROW_WISE,
}
#: TorchRec compute kernel value -> hiermem tier.
TIER = {
    "dense": TierPlacement.DEVICE,
    "fused": TierPlacement.DEVICE,
    "fused_uvm": TierPlacement.HOST,
    "fused_uvm_caching": TierPlacement.CACHED,
}


def _ebc(tables: Sequence[PlannerTable]):
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    return EmbeddingBagCollection(tables=[EmbeddingBagConfig(num_embeddings=t.num_rows, embedding_dim=t.dim,
                                                             name=t.name, feature_names=[t.name]) for t in tables],
                                  device=torch.device("meta"))


def torchrec_plan(tables: Sequence[PlannerTable], topology: Topology, batch_size: int, optimizer=None,
                  reserve: float = 0.0):
    """TorchRec's ``EmbeddingShardingPlanner`` plan of ``tables`` (CPU topology).

    Args:
        tables: the tables (rows, dim, pooling factor become TorchRec's configs and
            ``ParameterConstraints.pooling_factors``).
        topology: world size, ranks per host, and ``device_bytes + host_bytes`` as
            every rank's ``ddr_cap`` (``hbm_cap`` 0: a CPU topology).
        batch_size: samples per rank per step.
        optimizer: a hiermem optimizer; row-wise Adagrad is passed to TorchRec's sharder
            as ``EXACT_ROWWISE_ADAGRAD`` so its storage estimate counts the state.
        reserve: fraction of each rank's memory TorchRec keeps for dense parts (its
            ``HeuristicalStorageReservation``; 0: all of it for tables, like hiermem).

    Column-wise options: ``min_partition`` is ``dim / world_size`` (at least
    :data:`~hiermem.sharding.planner.MIN_CW_DIM`), so TorchRec may cut a table into as
    many column shards as there are ranks (its default, 128 columns, forbids CW below
    256 columns).  On a CPU topology TorchRec offers DP, TW, CW and TWCW (no RW).

    Returns:
        ``(torchrec ShardingPlan, hiermem ShardingPlan)``.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner import Topology as TRTopology
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
    from torchrec.distributed.planner.types import ParameterConstraints

    fused = {}
    if optimizer is not None and optimizer.name == "rowwise_adagrad":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": optimizer.lr}
    topo = TRTopology(world_size=topology.world_size, compute_device="cpu", hbm_cap=0,
                      ddr_cap=int(topology.device_bytes + topology.host_bytes),
                      local_world_size=topology.ranks_per_host)
    # TorchRec cuts column shards of ``min_partition`` columns (default 128): allow up to
    # one column shard per rank, as hiermem's CW options do
    W = topology.world_size
    cons = {t.name: ParameterConstraints(pooling_factors=[float(t.pooling_factor)],
                                         min_partition=max(MIN_CW_DIM, t.dim // W)) for t in tables}
    planner = EmbeddingShardingPlanner(topology=topo, batch_size=batch_size, constraints=cons,
                                       storage_reservation=HeuristicalStorageReservation(percentage=reserve))
    tr = planner.plan(_ebc(tables), [EmbeddingBagCollectionSharder(fused_params=fused or None)])
    return tr, translate(tr, tables, topology, batch_size, optimizer)


def translate(tr_plan, tables: Sequence[PlannerTable], topology: Topology, batch_size: int,
              optimizer=None) -> ShardingPlan:
    """A hiermem :class:`ShardingPlan` doing what TorchRec's plan says (see the module doc).

    Raises:
        InvalidArgumentError: a table is missing from the plan, or it uses a sharding
            type or compute kernel hiermem has no equivalent for.
    """
    from ..dataplane.optim import SGD
    from .planner import estimate, step_ms

    opt = OptimizerCost.of(optimizer if optimizer is not None else SGD())
    params = {}
    for mod in tr_plan.plan.values():
        params.update(mod)
    out = []
    for t in tables:
        ps = params.get(t.name)
        if ps is None:
            raise InvalidArgumentError(f"TorchRec's plan has no table {t.name}")
        st = SHARDING.get(str(ps.sharding_type))
        tier = TIER.get(str(ps.compute_kernel))
        if st is None or tier is None:
            raise InvalidArgumentError(f"table {t.name}: TorchRec's {ps.sharding_type}/{ps.compute_kernel} has no "
                                       "hiermem equivalent")
        out.append(_table(t, st, tier, ps, topology, batch_size, opt))
    p = ShardingPlan(topology.world_size, topology.ranks_per_host, tuple(out))
    rank_ms = estimate(p, tables, topology, batch_size, optimizer)
    return ShardingPlan(p.world_size, p.ranks_per_host, p.tables, tuple(rank_ms),
                        {"batch_size": batch_size, "source": "torchrec", "step_ms": step_ms(rank_ms, topology)})


def fit_tiers(p: ShardingPlan, tables: Sequence[PlannerTable], topology: Topology, batch_size: int,
              optimizer=None) -> ShardingPlan:
    """``p``'s shardings, ranks and columns with every shard in the fastest tier placement
    that fits its rank's budgets left (``topology``'s), costliest shards first.

    Raises:
        PlannerError: a shard fits in no tier placement of its rank (names the table).
    """
    import numpy as np

    from ..dataplane.optim import SGD
    from .planner import estimate, step_ms, tier_candidates
    from .types import PlannerError

    opt = OptimizerCost.of(optimizer if optimizer is not None else SGD())
    tabs = {t.name: t for t in tables}
    rem = np.tile([topology.device_bytes, topology.host_bytes, topology.ssd_bytes], (topology.world_size, 1))
    items = []
    for ti, tp in enumerate(p.tables):
        t = tabs[tp.name]
        for k, s in enumerate(tp.shards):
            shape = shard_shape(t, tp.sharding, topology, batch_size, s.row_parts, s.col_width or t.dim)
            items.append((ti, k, tier_candidates(t, tp.sharding, shape, topology, opt)))
    items.sort(key=lambda x: -float(x[2].seconds[0]))
    shards = [list(tp.shards) for tp in p.tables]
    for ti, k, c in items:
        s = shards[ti][k]
        fits = np.nonzero((c.nbytes <= rem[s.rank][None, :]).all(1))[0]
        if not fits.size:
            raise PlannerError(f"table {p.tables[ti].name}: a shard fits no tier of rank {s.rank}'s budgets left",
                               table=p.tables[ti].name)
        j = int(fits[0])
        ch, b = c.choices[j], c.nbytes[j]
        rem[s.rank] -= b
        shards[ti][k] = replace(s, tier=ch.tier, device_rows=int(ch.device_rows), host_rows=int(ch.host_rows),
                                est_ms=float(c.seconds[j]) * 1e3, device_bytes=float(b[0]), host_bytes=float(b[1]),
                                ssd_bytes=float(b[2]))
    q = ShardingPlan(p.world_size, p.ranks_per_host,
                     tuple(replace(tp, shards=tuple(sh)) for tp, sh in zip(p.tables, shards)))
    rank_ms = estimate(q, tables, topology, batch_size, optimizer)
    return ShardingPlan(q.world_size, q.ranks_per_host, q.tables, tuple(rank_ms),
                        {**p.meta, "tiers": "fit to budgets", "step_ms": step_ms(rank_ms, topology)})


def _cache_rows(ps, rows: int) -> Optional[int]:
    clf = (ps.cache_params.load_factor if getattr(ps, "cache_params", None) is not None else None)
    return None if clf is None else max(1, int(math.ceil(clf * rows)))


def _table(t: PlannerTable, st: ShardingType, tier: TierPlacement, ps, topology: Topology, batch: int,
           opt: OptimizerCost) -> TablePlan:
    if st is ShardingType.DATA_PARALLEL:
        ranks = list(range(topology.world_size))
        spans = [(0, t.dim)] * len(ranks)
    else:
        shards = sorted(ps.sharding_spec.shards, key=lambda s: (s.shard_offsets[1], s.shard_offsets[0]))
        ranks = [int(s.placement.rank()) for s in shards]
        spans = [(int(s.shard_offsets[1]), int(s.shard_sizes[1])) for s in shards]
    shards_out = []
    n = len(ranks)
    for k, (r, (c0, w)) in enumerate(zip(ranks, spans)):
        rowwise = st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
        parts = n if rowwise else 1
        shape = shard_shape(t, st, topology, batch, parts, w)
        rows = shape.rows
        if tier is TierPlacement.DEVICE:
            ch = TierChoice(tier, rows, 1)
        elif tier is TierPlacement.HOST:
            ch = TierChoice(tier, 1, rows)
        else:
            c = _cache_rows(ps, rows) or max(1, rows // 5)
            ch = TierChoice(tier, min(c, rows), max(1, rows - c))
        b = storage(shape, ch, opt)
        c0, w = (0, t.dim) if rowwise else (c0, w)
        shards_out.append(ShardPlan(r, k if rowwise else 0, parts, c0, w,
                                    tier, int(ch.device_rows), int(ch.host_rows), 0.0, b.device, b.host, b.ssd))
    return TablePlan(t.name, st, tuple(shards_out), t.dim)


__all__ = ["SHARDING", "TIER", "fit_tiers", "torchrec_plan", "translate"]
