"""The store: :class:`HierarchicalStore` (the facade) and the parts it owns.

Residency (the placement engine over the key index and the device and host tiers),
multi-table batches and prefetch pins, the pooled bag ops, CUDA staging, checkpoints,
read-only handles, saved metadata, input checks and lock files.
"""

from .hierarchical import HierarchicalStore

__all__ = ["HierarchicalStore"]
