"""4-D embedding parallelism: a cost-model planner and sharded execution on torch.distributed.

* :mod:`.types`: :class:`ShardingType`, :class:`TierPlacement`, :class:`Topology`,
  :class:`PlannerTable`, the frozen JSON-serialisable :class:`ShardingPlan`, :class:`PlannerError`.
* :mod:`.cost`: the pure cost model (:class:`Perf`, :class:`Storage`, hit rates).
* :mod:`.planner`: :func:`plan` (stages: enumerate, estimate, greedy LPT search),
  :func:`naive_plan`, :func:`estimate`; :mod:`.rules`: one rule per sharding type and tier.
* :mod:`.torchrec_plan`: TorchRec's ``EmbeddingShardingPlanner`` on the same tables,
  its plan translated into a :class:`ShardingPlan` (needs torchrec).
* :mod:`.module`: :class:`ShardedEmbeddingBagCollection`; :mod:`.dist`: :func:`launch_local`.
* :mod:`.config`: TOML/JSON planner configs and the ``hiermem plan`` table.
"""

from .cost import Perf, Storage, hit_rate
from .dist import launch_local
from .module import ShardedEmbeddingBagCollection, ShardStore
from .planner import estimate, naive_plan, plan
from .types import (PlannerError, PlannerErrorKind, PlannerTable, ShardingPlan, ShardingType, ShardPlan, TablePlan,
                    TierPlacement, Topology)

__all__ = [
    "Perf", "PlannerError", "PlannerErrorKind", "PlannerTable", "ShardStore", "ShardedEmbeddingBagCollection",
    "ShardingPlan", "ShardingType", "ShardPlan", "Storage", "TablePlan", "TierPlacement", "Topology", "estimate",
    "hit_rate", "launch_local", "naive_plan", "plan",
]
