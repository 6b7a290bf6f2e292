"""The tiers of the hierarchy: fixed-slot device and host tiers over an LMDB disk tier."""

from .disk import DiskTier
from .host import HostTier
from .slots import SlotTier

__all__ = ["DiskTier", "HostTier", "SlotTier"]
