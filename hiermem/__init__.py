"""hiermem: a hierarchical embedding memory manager for PyTorch recommendation training.

Hot rows live in device memory, warm rows in (pinned) host memory, cold rows in an
LMDB store on disk; lookups and fused optimizer updates work on whole batches.
"""

from .errors import (CapacityError, DiskFullError, HierMemError, InvalidArgumentError, InvalidIdError,
                     InvalidTypeError, LayoutMismatchError, NonFiniteGradientError, PolicyFileError, StoreClosedError,
                     StoreFormatError, UnknownTableError)
from .errors import MissingDependencyError, TraceFormatError  # offline policy tuning (hiermem.sim)
from .errors import ReadOnlyStoreError, StoreIOError  # hardening and read-only readers (issue 19)
from .errors import StoreVersionError  # the disk format version (issue 16)
from .nn.features import SparseFeatures
from .core.policies import LFU, LRU, POLICIES, EvictionPolicy, PolicySpec, register_policy, resolve_policy
from .observe.metrics import STORES, MetricsRegistry, StoreCollector, serve_metrics
from .dataplane.optim import SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad
from .observe.stats import IO, Stat
from .store.hierarchical import HierarchicalStore
from .store.multi import Ticket
from .nn.modules import CachedEmbeddingBagCollection
from .nn.pipeline import PrefetchPipeline
from .types import StoreConfig, TableSpec, Tier, default_device
from .sharding import (PlannerError, PlannerTable, ShardedEmbeddingBagCollection, ShardingPlan, ShardingType,
                       TierPlacement, Topology, launch_local)

__version__ = "0.1.0"

__all__ = [
    "MissingDependencyError", "TraceFormatError",
    "ReadOnlyStoreError", "StoreIOError", "StoreVersionError",
    "Adagrad", "Adam", "CachedEmbeddingBagCollection", "PrefetchPipeline", "Ticket", "CapacityError", "DiskFullError", "EvictionPolicy", "HierMemError", "HierarchicalStore",
    "IO", "InvalidArgumentError", "MetricsRegistry", "STORES", "StoreCollector", "InvalidIdError", "InvalidTypeError", "LFU", "LRU", "LayoutMismatchError",
    "NonFiniteGradientError", "Optimizer", "POLICIES", "PolicyFileError", "PolicySpec", "RowWiseAdagrad", "SGD", "SparseFeatures",
    "Stat", "StoreClosedError", "StoreConfig", "StoreFormatError", "TableSpec", "Tier", "UnknownTableError",
    "default_device", "register_policy", "resolve_policy", "serve_metrics",
    # sharding (issue 6)
    "PlannerError", "PlannerTable", "ShardedEmbeddingBagCollection", "ShardingPlan", "ShardingType", "TierPlacement",
    "Topology", "launch_local",
]
