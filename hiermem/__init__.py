"""hiermem: a hierarchical embedding memory manager for PyTorch recommendation training.

Hot rows live in device memory, warm rows in (pinned) host memory, cold rows in an
LMDB store on disk; lookups and fused optimizer updates work on whole batches.
"""

from .errors import (CapacityError, DiskFullError, HierMemError, InvalidArgumentError, InvalidIdError,
                     InvalidTypeError, LayoutMismatchError, NonFiniteGradientError, PolicyFileError,
                     StoreClosedError, StoreFormatError, UnknownTableError)
from .errors import MissingDependencyError, TraceFormatError  # offline policy tuning (hiermem.sim)
from .errors import ReadOnlyStoreError, StoreIOError  # hardening and read-only readers (issue 19)
from .errors import StoreVersionError  # the disk format version (issue 16)
from .features import SparseFeatures
from .eviction import LFU, LRU, POLICIES, EvictionPolicy, PolicySpec, register_policy, resolve_policy
from . import eviction_ext  # noqa: F401  (registers lfu_decay and lookahead in POLICIES)
from .metrics import STORES, MetricsRegistry, StoreCollector, serve_metrics
from .optim import SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad
from .stats import IO, Stat
from .store import HierarchicalStore
from .batched import Ticket
from .modules import CachedEmbeddingBagCollection
from .pipeline import PrefetchPipeline
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

from .core.warm import ensure_compiled as _ensure_compiled  # noqa: E402

_ensure_compiled()  # a fresh install compiles its kernels here, once, with a notice
