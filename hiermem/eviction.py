"""Eviction policies: one small vectorised protocol, shared by the store and the simulator.

A tier owns its slots; a policy only scores them.  Every hook takes a tensor of slots
(a whole batch at once) and the policy keeps one int64 *eviction key* per slot: the
victims are the evictable slots with the smallest keys.  Policies are resolved by name
through :data:`POLICIES` (or from a TOML policy file) once, when a tier is built.

``clock`` values are the store's global access counter: the position of a row's last
access in the stream of all ids looked up, so LRU order is exact per access even inside
one batch.

Victims are the ``n`` evictable slots with the smallest ``(key, slot)``: ties go to the
lower slot, so every caller that asks the same question gets the same answer.  Finding
them by a pass over the tier costs O(capacity) per evicting batch (a host tier of 10M
rows: ~0.3 s), so an :attr:`EvictionPolicy.incremental` policy (LRU, LFU) keeps a
*reservoir*: the slots whose keys were at most a threshold ``tau`` when it was built,
sorted by ``(key, slot)``, plus every slot whose key was set to at most ``tau`` since
(all key writes go through :meth:`EvictionPolicy._set_keys`).  Invariant: every occupied
slot with a key ``<= tau`` has an entry holding its current key, so the smallest
evictable entries that are still current are the exact victims; stale entries (the key
changed, the slot was emptied) are skipped and dropped.  It is rebuilt, by one pass, when
it runs out: about every ``capacity / 8 / n`` evicting batches.  The caller describes
what is evictable with an :class:`Evictable` (per slot, and a count), never a mask over
the whole tier.
"""

from __future__ import annotations

import os
import tomllib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from .errors import InvalidArgumentError, PolicyFileError

_INT64_MAX = torch.iinfo(torch.int64).max
_CLOCK_BITS = 40  # LFU keys pack (count, last clock) as count << 40 | clock


class Evictable(Protocol):
    """What a tier may evict now (occupied, unpinned, not used by the batch at hand)."""

    #: evictable slots
    count: int
    #: occupied slots that are not evictable (pinned, or excluded by the batch)
    held: int

    def at(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool per slot in ``slots``: evictable now."""

    def occupied(self) -> torch.Tensor:
        """Bool mask over the whole tier: occupied slots (for a reservoir rebuild)."""

    def mask(self) -> torch.Tensor:
        """Bool mask over the whole tier: evictable slots."""


def smallest(slots: torch.Tensor, keys: torch.Tensor, n: int, distinct_sorted: bool = False) -> torch.Tensor:
    """The ``n`` entries with the smallest ``(key, slot)``, in that order.  Entries of the
    same slot must carry the same key (duplicates count once); ``distinct_sorted``:
    ``slots`` are distinct and ascending already.

    Raises:
        InvalidArgumentError: fewer than ``n`` distinct slots.
    """
    if not distinct_sorted and slots.numel() > 1:
        o = torch.sort(slots, stable=True).indices
        slots, keys = slots.index_select(0, o), keys.index_select(0, o)
        keep = torch.ones_like(slots, dtype=torch.bool)
        keep[1:] = slots[1:] != slots[:-1]
        slots, keys = slots[keep], keys[keep]
    if slots.numel() < n:
        raise InvalidArgumentError(f"need {n} victims, only {slots.numel()} evictable")
    if slots.numel() > n:  # the n-th key; below it all, at it the lowest slots (slots are sorted)
        kth = torch.kthvalue(keys, n).values
        below, tie = keys < kth, keys == kth
        take = below | (tie & (torch.cumsum(tie, 0) <= n - below.sum()))
        slots, keys = slots[take], keys[take]
    o = torch.sort(keys, stable=True).indices  # stable: slot order among equal keys
    return slots.index_select(0, o)


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
        self._reset_reservoir()

    #: True for policies whose keys change only through :meth:`_set_keys` (the hooks
    #: below); their victims come from the reservoir (module docstring).
    incremental: ClassVar[bool] = False
    #: a reservoir rebuild keeps about this fraction of the occupied slots
    RESERVOIR_FRACTION: ClassVar[int] = 8
    #: pending entries (keys set at or below the threshold since the build) beyond which,
    #: and beyond 4x the victims asked for, they are sorted into the reservoir
    PENDING_MERGE: ClassVar[int] = 1 << 16

    def _reset_reservoir(self) -> None:
        self._drop_reservoir()
        self.reservoir_builds = 0
        self.merges = 0

    def _drop_reservoir(self) -> None:
        self._tau = None  # no reservoir: the next victims() call builds one
        self._res_s = self._res_k = None
        self._pos = 0
        self._pend: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._npend = 0

    def _pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending entries, concatenated."""
        return torch.cat([s for s, _ in self._pend]), torch.cat([k for _, k in self._pend])

    def _current(self, slots: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries whose key is still the slot's key."""
        m = self.key.index_select(0, slots) == keys
        return slots[m], keys[m]

    def _set_keys(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Set the keys of ``slots`` (keeping the reservoir's invariant)."""
        self.key[slots] = keys
        if self._tau is not None:
            m = keys <= self._tau
            s, k = slots[m], keys[m]
            if s.numel():
                self._pend.append((s, k))
                self._npend += s.numel()
                if self._npend > max(1 << 16, self.capacity // 4):  # no evictions for long: let it go
                    self._drop_reservoir()

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
        self._set_keys(slots, carried)

    def victims(self, n: int, evictable: "torch.Tensor | Evictable") -> torch.Tensor:
        """``n`` slots to evict, the smallest ``(key, slot)`` first, among ``evictable``
        (an :class:`Evictable`, or a bool mask over the tier).

        Raises:
            InvalidArgumentError: fewer than ``n`` slots are evictable (cachetools' "cache
                is empty" rule: a policy never evicts what it must keep).
        """
        if n <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.key.device)
        if isinstance(evictable, torch.Tensor):
            return self._scan(n, evictable)
        ev = evictable
        if ev.count < n:
            raise InvalidArgumentError(f"need {n} victims, only {ev.count} evictable")
        r = max(8 * n, (ev.count + ev.held) // self.RESERVOIR_FRACTION, 4096) + ev.held
        if not self.incremental or r >= ev.count + ev.held:  # a reservoir would hold about every slot
            return self._scan(n, ev.mask())
        if self._tau is not None and self._npend > max(self.PENDING_MERGE, 4 * n):
            self._merge_pending()  # too many entries outside the sorted part
        for _attempt in range(2):
            if self._tau is None:
                self._build(r, ev)
            v = self._from_reservoir(n, ev)
            if v is not None:
                return v
            self._drop_reservoir()
        raise AssertionError("a fresh reservoir holds every evictable slot's key it needs")

    def _scan(self, n: int, mask: torch.Tensor) -> torch.Tensor:
        """Victims by a pass over the tier (``mask``: evictable slots)."""
        self._drop_reservoir()
        cand = mask.nonzero().squeeze(1)
        if cand.numel() < n:
            raise InvalidArgumentError(f"need {n} victims, only {cand.numel()} evictable")
        return smallest(cand, self.key.index_select(0, cand), n, distinct_sorted=True)

    def _build(self, r: int, ev: "Evictable") -> None:
        """A reservoir of the ``r`` occupied slots of smallest key (and their ties)."""
        cand = ev.occupied().nonzero().squeeze(1)
        keys = self.key.index_select(0, cand)
        if r >= cand.numel():
            tau = float("inf")
        else:
            tau = torch.kthvalue(keys, r).values.item()
            m = keys <= tau
            cand, keys = cand[m], keys[m]
        o = torch.sort(keys, stable=True).indices  # cand ascending: (key, slot) order
        self._res_s, self._res_k = cand.index_select(0, o), keys.index_select(0, o)
        self._pos, self._pend, self._npend, self._tau = 0, [], 0, tau
        self.reservoir_builds += 1

    def _merge_pending(self) -> None:
        """Sort the current pending entries into the reservoir's sorted part."""
        ps, pk = self._pending()
        ps, pk = self._current(torch.cat((self._res_s[self._pos:], ps)), torch.cat((self._res_k[self._pos:], pk)))
        o = torch.sort(ps, stable=True).indices
        ps, pk = ps.index_select(0, o), pk.index_select(0, o)
        o = torch.sort(pk, stable=True).indices
        self._res_s, self._res_k = ps.index_select(0, o), pk.index_select(0, o)
        self._pos, self._pend, self._npend = 0, [], 0
        self.merges += 1

    def _from_reservoir(self, n: int, ev: "Evictable") -> torch.Tensor | None:
        """The exact victims from the reservoir, or None when it holds too few."""
        if self._pend:  # keep the pending entries that are still current
            ps, pk = self._current(*self._pending())
            self._pend, self._npend = ([(ps, pk)] if ps.numel() else []), ps.numel()
        else:
            ps, pk = self._res_s[:0], self._res_k[:0]
        out_s, out_k = [], []
        found, p, c, lead = 0, self._pos, max(2 * n, 1024), True
        total = self._res_s.numel()
        while found < n and p < total:
            s, k = self._res_s[p:p + c], self._res_k[p:p + c]
            cur = self.key.index_select(0, s) == k
            if lead:  # stale entries at the front are gone for good
                live = cur.nonzero()
                if live.numel():
                    self._pos = p + int(live[0])
                    lead = False
                else:
                    self._pos = p + s.numel()
            ok = cur & ev.at(s)
            out_s.append(s[ok])
            out_k.append(k[ok])
            found += int(ok.sum())
            p += s.numel()
            c *= 2
        pok = ev.at(ps)
        out_s.append(ps[pok])
        out_k.append(pk[pok])
        slots, keys = torch.cat(out_s), torch.cat(out_k)
        try:
            return smallest(slots, keys, n)
        except InvalidArgumentError:
            return None

    def check_reservoir(self, occupied: torch.Tensor) -> None:
        """Assert the reservoir's invariant (a debugging aid; O(capacity))."""
        if self._tau is None:
            return
        need = (occupied & (self.key <= self._tau)).nonzero().squeeze(1)
        cur, _ = self._current(self._res_s[self._pos:], self._res_k[self._pos:])
        if self._pend:
            cur = torch.cat((cur, self._current(*self._pending())[0]))
        missing = need[~torch.isin(need, cur)]
        assert missing.numel() == 0, f"{self.name}: slots {missing[:8].tolist()} with keys <= tau not in the reservoir"


class LRU(EvictionPolicy):
    """Least recently used: the key is the clock of the slot's last access."""

    name = "lru"
    incremental = True

    def on_access(self, slots, clock, counts):
        self._set_keys(slots, clock)

    def on_insert(self, slots, clock, counts):
        self._set_keys(slots, clock)


class LFU(EvictionPolicy):
    """Least frequently used; ties go to the least recently used (as ``cachetools.LFUCache``).

    The key packs ``count << 40 | last_clock``.  A row inserted from disk starts with the
    count of its accesses in the inserting batch; rows moving between tiers keep theirs.
    """

    name = "lfu"

    @staticmethod
    def _pack(count: torch.Tensor, clock: torch.Tensor) -> torch.Tensor:
        return (count.clamp(max=(1 << 22) - 1) << _CLOCK_BITS) | (clock & ((1 << _CLOCK_BITS) - 1))

    incremental = True

    def on_access(self, slots, clock, counts):
        old = self.key.index_select(0, slots) >> _CLOCK_BITS
        self._set_keys(slots, self._pack(old + counts, clock))

    def on_insert(self, slots, clock, counts):
        self._set_keys(slots, self._pack(counts, clock))


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

