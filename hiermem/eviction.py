"""Eviction policies: one small vectorised protocol, shared by the store and the simulator.

A tier owns its slots; a policy only scores them.  Every hook takes a tensor of slots
(a whole batch at once) and the policy keeps one int64 *eviction key* per slot: the
victims are the evictable slots with the smallest keys.  Policies are resolved by name
through :data:`POLICIES` (or from a TOML policy file) once, when a tier is built.

``clock`` values are the store's global access counter: the position of a row's last
access in the stream of all ids looked up, so LRU order is exact per access even inside
one batch.
"""

from __future__ import annotations

import os
import tomllib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from .errors import InvalidArgumentError, PolicyFileError

_INT64_MAX = torch.iinfo(torch.int64).max
_CLOCK_BITS = 40  # LFU keys pack (count, last clock) as count << 40 | clock


class EvictionPolicy(ABC):
    """Scores the slots of one tier.

    Args:
        capacity: number of slots.
        device: where the per-slot state lives (the tier's device).
    """

    name: ClassVar[str]

    def __init__(self, capacity: int, device: torch.device | str = "cpu", **params: Any):
        if params:
            raise PolicyFileError(f"policy {self.name!r} takes no parameters {sorted(params)}")
        self.capacity = int(capacity)
        self.key = torch.zeros(self.capacity, dtype=torch.int64, device=device)

    @abstractmethod
    def on_access(self, slots: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor) -> None:
        """Resident ``slots`` were used ``counts`` times, last at access ``clock``."""

    @abstractmethod
    def on_insert(self, slots: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor) -> None:
        """Rows new to the cache (from disk or the initialiser) entered ``slots``."""

    def on_remove(self, slots: torch.Tensor) -> None:
        """Rows left ``slots`` (evicted, promoted or dropped)."""

    #: True for policies that use :meth:`on_lookahead` (the store's prefetch pipeline and
    #: the simulator call it only for them).
    wants_lookahead: ClassVar[bool] = False

    def on_lookahead(self, slots: torch.Tensor) -> None:
        """The rows in ``slots`` will be used by the next ``window`` batches; this set
        replaces the previous call's.  Called before a batch's lookup is resolved, by
        whoever knows the future: the simulator (from the trace) or the prefetch pipeline
        (from its queue of upcoming batches).  Default: ignored."""

    def carry(self, slots: torch.Tensor) -> torch.Tensor:
        """State to hand to another tier when rows move (keeps recency/frequency)."""
        return self.key.index_select(0, slots)

    def on_carry_in(self, slots: torch.Tensor, carried: torch.Tensor) -> None:
        """Rows moved in from another tier of the same policy, with their :meth:`carry`."""
        self.key[slots] = carried

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """``n`` slots to evict among ``evictable`` (bool per slot), sorted smallest key first.

        Raises:
            ValueError: fewer than ``n`` slots are evictable (cachetools' "cache is
                empty" rule: a policy never evicts what it must keep).
        """
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.key.device)
        cand = evictable.nonzero().squeeze(1)
        if cand.numel() < n:
            raise InvalidArgumentError(f"need {n} victims, only {cand.numel()} evictable")
        keys = self.key.index_select(0, cand)
        return cand[torch.topk(keys, n, largest=False, sorted=True).indices]


class LRU(EvictionPolicy):
    """Least recently used: the key is the clock of the slot's last access."""

    name = "lru"

    def on_access(self, slots, clock, counts):
        self.key[slots] = clock

    def on_insert(self, slots, clock, counts):
        self.key[slots] = clock


class LFU(EvictionPolicy):
    """Least frequently used; ties go to the least recently used (as ``cachetools.LFUCache``).

    The key packs ``count << 40 | last_clock``.  A row inserted from disk starts with the
    count of its accesses in the inserting batch; rows moving between tiers keep theirs.
    """

    name = "lfu"

    @staticmethod
    def _pack(count: torch.Tensor, clock: torch.Tensor) -> torch.Tensor:
        return (count.clamp(max=(1 << 22) - 1) << _CLOCK_BITS) | (clock & ((1 << _CLOCK_BITS) - 1))

    def on_access(self, slots, clock, counts):
        old = self.key.index_select(0, slots) >> _CLOCK_BITS
        self.key[slots] = self._pack(old + counts, clock)

    def on_insert(self, slots, clock, counts):
        self.key[slots] = self._pack(counts, clock)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator adding a policy to the registry under ``cls.name``."""
    POLICIES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class PolicySpec:
    """A resolved policy: its registry name and constructor parameters."""

    name: str
    params: dict = field(default_factory=dict)
    source: str | None = None  # the policy file it came from, if any

    def build(self, capacity: int, device: torch.device | str) -> EvictionPolicy:
        return POLICIES[self.name](capacity, device, **self.params)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}


_FILE_KEYS = {"name", "description", "params", "device_rows", "host_rows", "prefetch_depth"}


def resolve_policy(policy: str | os.PathLike) -> PolicySpec:
    """A policy name (``"lru"``) or the path of a TOML policy file -> :class:`PolicySpec`.

    A policy file looks like::

        name = "lfu"                 # registry name
        description = "..."          # optional
        [params]                     # optional constructor parameters

    Raises:
        PolicyFileError: unknown policy name, unreadable file, unknown keys.
    """
    s = os.fspath(policy)
    if s in POLICIES:
        return PolicySpec(s)
    path = Path(s)
    if path.suffix != ".toml" or not path.is_file():
        raise PolicyFileError(f"unknown policy {s!r}: not one of {sorted(POLICIES)} nor a policy .toml file")
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise PolicyFileError(f"{path}: cannot read policy file: {e}") from e
    unknown = set(doc) - _FILE_KEYS
    if unknown:
        raise PolicyFileError(f"{path}: unknown keys {sorted(unknown)} (allowed: {sorted(_FILE_KEYS)})")
    name = doc.get("name")
    if name not in POLICIES:
        raise PolicyFileError(f"{path}: unknown policy name {name!r} (known: {sorted(POLICIES)})")
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise PolicyFileError(f"{path}: [params] must be a table")
    spec = PolicySpec(name, dict(params), str(path.resolve()))  # reopenable from any cwd
    try:
        spec.build(1, "cpu")  # validate parameters now, not at first eviction
    except (TypeError, ValueError) as e:
        raise PolicyFileError(f"{path}: bad parameters for {name!r}: {e}") from e
    return spec


from . import eviction_ext  # noqa: E402,F401  (registers lfu_decay and lookahead)

