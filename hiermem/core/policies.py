"""Eviction policies: a compiled key per slot (:mod:`hiermem.core.policy`), shared by the
store and the simulator, resolved by name through :data:`POLICIES` (or a TOML policy
file) once, when a tier is built.

A policy keeps one int64 *eviction key* per slot; the victims are the evictable slots
with the smallest ``(key, slot)`` (ties go to the lower slot, so every caller that asks
the same question gets the same answer).  ``clock`` values are the store's global access
counter: the position of a row's last access in the stream of all ids looked up, so LRU
order is exact per access even inside one batch.  The store and the simulator never call
the methods below per batch: their placement kernels (:mod:`hiermem.core.plan`) update
:attr:`EvictionPolicy.state` directly.  The methods are the same kernels, batch by batch,
for tools and tests.

Victims come from the tier's reservoir (:mod:`hiermem.core.victims`): exact, without a
pass over the tier per evicting batch.

Every policy takes ``admission``: ``"off"`` (the default) or ``"tinylfu"``, a frequency
filter in front of the device tier (:mod:`hiermem.core.admission`): a row entering the
full device tier stays only if its estimated frequency beats its victims'; else it is
the next victim.  It is a parameter like any other (a policy file's ``[params]``,
``PolicySpec(name, {"admission": "tinylfu"})``).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from . import admission as _adm
from . import policy as _pk
from . import queues as _qk
from . import names as _names
from . import victims as _vk
from .index import as_array
from ..errors import InvalidArgumentError, InvalidTypeError, PolicyFileError


class EvictionPolicy:
    """Scores the slots of one tier (state in flat arrays, updated by compiled kernels).

    Args:
        capacity: number of slots.
        device: ignored (the control plane is always on the CPU); kept for callers.
        admission: ``"off"`` or ``"tinylfu"``: the frequency filter in front of the
            device tier (:mod:`hiermem.core.admission`; the tier that holds the policy
            turns it on, :meth:`attach_admission`: the host tier never does).
    """

    name: ClassVar[str]
    #: the policy's code in :mod:`hiermem.core.policy`
    code: ClassVar[int]
    #: True for policies that use :meth:`on_lookahead` (the store's prefetch pipeline and
    #: the simulator call it only for them).
    wants_lookahead: ClassVar[bool] = False

    def __init__(self, capacity: int, device: torch.device | str = "cpu", admission: str = "off", **params: Any):
        if params:
            raise PolicyFileError(f"policy {self.name!r} takes no parameters {sorted(params)}")
        self.admission = _admission(admission)
        self._hashes = _qk.is_queue(self.code)
        self.capacity = C = int(capacity)
        self._key = np.zeros(C, dtype=np.int64)
        self._score = np.zeros(C, dtype=np.float64)
        self._uses = np.zeros(C, dtype=np.int64)
        self.key = torch.from_numpy(self._key)
        hc = _vk.heap_capacity(C)
        self.state = (self._key, self._score, self._uses, np.array(self._params(), dtype=np.float64),
                      _vk.new_state(C), np.empty(C, dtype=np.int64), np.empty(C, dtype=np.int64),
                      np.empty(hc, dtype=np.int64), np.empty(hc, dtype=np.int64),
                      np.empty(hc, dtype=np.int64), np.empty(hc, dtype=np.int64))

    def adopt_keys(self, key: np.ndarray) -> None:
        """Keep the keys in ``key`` (int64, at least ``capacity`` entries; the tier's
        slot records, :mod:`hiermem.core.layout`) instead of an array of their own."""
        key[:self.capacity] = self._key
        self._key = key
        self.key = torch.from_numpy(key[:self.capacity])
        self.state = (key,) + self.state[1:]

    def _params(self) -> list[float]:
        return [float(self.code), 0.0, 0.0, 0.0]

    def attach_admission(self) -> None:
        """Turn the admission filter on, if the policy was built with one: its sketch and
        per-slot row hashes go in a region of the state's ``hs`` past the policy's own
        (a device tier calls this once, before any row enters)."""
        if self.admission == "off" or self.filtering:
            return
        st = list(self.state)
        hs = st[_names.P_HEAP_S]
        off = hs.size
        grown = np.zeros(off + _adm.size(self.capacity), dtype=np.int64)
        grown[:off] = hs
        st[_names.P_HEAP_S] = grown
        self.state = tuple(st)
        _adm.init(st[_names.P_RM], grown, off, self.capacity, _adm.ADMISSIONS[self.admission])
        self._hashes = True

    @property
    def filtering(self) -> bool:
        """Whether the admission filter is on (:meth:`attach_admission`)."""
        return bool(self.state[_names.P_RM][_names.A_ON])

    @property
    def hashes(self) -> bool:
        """Whether the placement must give this policy its rows' hashes (``ws[RH]``): a
        queue policy's, or one with the admission filter on."""
        return self._hashes

    def _reset_admission(self) -> None:
        rm = self.state[_names.P_RM]
        if rm[_names.A_ON]:
            _adm.init(rm, self.state[_names.P_HEAP_S], int(rm[_names.A_HASH]), self.capacity, int(rm[_names.A_ON]))

    @property
    def incremental(self) -> bool:
        return _pk.incremental(self.code)

    @property
    def reservoir_builds(self) -> int:
        return int(self.state[_names.P_RM][_names.RM_BUILDS])

    @property
    def reservoir(self) -> bool:
        """Whether victims come from the reservoir (True) or a pass over the tier per
        evicting batch (False: the reference the tests compare it with)."""
        return not self.state[4][_vk.SCAN_ONLY]

    @reservoir.setter
    def reservoir(self, on: bool) -> None:
        self.state[4][_vk.SCAN_ONLY] = 0 if on else 1

    def reset(self) -> None:
        """Forget the victim search and the admission filter's counts (every slot was emptied)."""
        rm = self.state[4]
        rm[:_vk.SCAN_ONLY] = 0
        self._reset_admission()

    def on_access(self, slots, clock, counts) -> None:
        """Resident ``slots`` were used ``counts`` times, last at access ``clock``."""
        _pk.access(self.state, as_array(slots), as_array(clock), as_array(counts), False)

    def on_insert(self, slots, clock, counts) -> None:
        """Rows new to the cache (from disk or the initialiser) entered ``slots``."""
        _pk.access(self.state, as_array(slots), as_array(clock), as_array(counts), True)

    def on_remove(self, slots) -> None:
        """Rows left ``slots`` (evicted, promoted or dropped): their keys go stale."""

    def carry(self, slots) -> torch.Tensor:
        """State to hand to another tier when rows move: ``[n, 3]`` float64 (key bits,
        score, uses)."""
        s = as_array(slots)
        out = np.empty((s.size, 3), dtype=np.float64)
        out[:, 0] = self._key[s].view(np.float64)
        out[:, 1] = self._score[s]
        out[:, 2] = self._uses[s]
        return torch.from_numpy(out)

    def on_carry_in(self, slots, carried) -> None:
        """Rows moved in from another tier of the same policy, with their :meth:`carry`."""
        c = as_array(carried, np.float64)
        _pk.carry_in(self.state, as_array(slots), np.ascontiguousarray(c[:, 0]).view(np.int64),
                     np.ascontiguousarray(c[:, 1]), c[:, 2].astype(np.int64))

    def on_lookahead(self, slots, next_use=None) -> None:
        """The rows in ``slots`` will be used by the next ``window`` batches; this set
        replaces the previous call's; ``next_use``: how many batches ahead each is next
        used.  Default: ignored."""

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """``n`` slots to evict, the smallest ``(key, slot)`` first, among the slots of
        the bool mask ``evictable`` (one pass; the store's placement uses the reservoir).

        Raises:
            InvalidArgumentError: fewer than ``n`` slots are evictable (cachetools' "cache
                is empty" rule: a policy never evicts what it must keep).
        """
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        ev = as_array(evictable, np.bool_)
        keys_t = np.where(ev, 0, -1).astype(np.int64)
        out = np.empty(n, dtype=np.int64)
        got = _vk.scan(self.state, keys_t, np.zeros(self.capacity, np.int32), np.zeros(self.capacity, np.uint8),
                       n, out)
        if got < n:
            raise InvalidArgumentError(f"need {n} victims, only {got} evictable")
        return torch.from_numpy(out)

    def check_reservoir(self, occupied) -> None:
        """Assert the reservoir's invariant (a debugging aid; O(capacity))."""
        kt = np.where(as_array(occupied, np.bool_), 0, -1).astype(np.int64)
        assert _vk.check(self.state, kt), f"{self.name}: a slot with a key <= tau is not in the reservoir"


class LRU(EvictionPolicy):
    """Least recently used: the key is the clock of the slot's last access."""

    name = "lru"
    code = _pk.LRU


class LFU(EvictionPolicy):
    """Least frequently used; ties go to the least recently used (as ``cachetools.LFUCache``).

    The key packs ``count << 40 | last_clock``.  A row inserted from disk starts with the
    count of its accesses in the inserting batch; rows moving between tiers keep theirs.
    """

    name = "lfu"
    code = _pk.LFU


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

    def build(self, capacity: int, device: torch.device | str = "cpu") -> EvictionPolicy:
        return POLICIES[self.name](capacity, device, **self.params)

    def to_dict(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}


_FILE_KEYS = {"name", "description", "params", "device_rows", "host_rows", "prefetch_depth"}


#: what a policy file's tier sizes and depth must be: (key, smallest value)
POLICY_SETTINGS = (("device_rows", 1), ("host_rows", 1), ("prefetch_depth", 0))


def _read_policy_file(policy: str | os.PathLike) -> tuple[Path, dict] | None:
    """``(path, document)`` of a policy file, or None for a registry name."""
    s = os.fspath(policy)
    if s in POLICIES:
        return None
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
    return path, doc


def policy_settings(policy: str | os.PathLike) -> dict[str, int]:
    """The tier sizes and prefetch depth a policy file names (``device_rows``,
    ``host_rows``, ``prefetch_depth``; only those it has); ``{}`` for a registry name.

    :class:`~hiermem.StoreConfig` applies them where its own argument is None, and
    :class:`~hiermem.PrefetchPipeline` the depth where its ``depth`` is None.

    Raises:
        PolicyFileError: unreadable file, unknown keys, or a value that is not an int
            at least its minimum (naming the key).
    """
    got = _read_policy_file(policy)
    if got is None:
        return {}
    path, doc = got
    out = {}
    for key, least in POLICY_SETTINGS:
        if key in doc:
            v = doc[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise PolicyFileError(f"{path}: {key} must be an int >= {least}, got {v!r}")
            out[key] = v
    return out


def resolve_policy(policy: str | os.PathLike) -> PolicySpec:
    """A policy name (``"lru"``) or the path of a TOML policy file -> :class:`PolicySpec`.

    A policy file looks like::

        name = "lfu"                 # registry name
        description = "..."          # optional
        device_rows = 4096           # optional tier sizes and prefetch depth: applied by
        host_rows = 65536            #   StoreConfig / PrefetchPipeline where their own
        prefetch_depth = 2           #   arguments are not given (see policy_settings)
        [params]                     # optional constructor parameters

    Raises:
        PolicyFileError: unknown policy name, unreadable file, unknown keys.
    """
    got = _read_policy_file(policy)
    if got is None:
        return PolicySpec(os.fspath(policy))
    path, doc = got
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

def _admission(v) -> str:
    """A policy's ``admission`` parameter, checked."""
    if not isinstance(v, str):
        raise InvalidTypeError(f"admission must be one of {sorted(_adm.ADMISSIONS)}, got {v!r}")
    if v not in _adm.ADMISSIONS:
        raise InvalidArgumentError(f"admission must be one of {sorted(_adm.ADMISSIONS)}, got {v!r}")
    return v


def _number(name: str, v, lo: float, integer: bool = False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise InvalidTypeError(f"{name} must be {'an int' if integer else 'a number'}, got {v!r}")
    if not (math.isfinite(v) and v >= lo):
        raise InvalidArgumentError(f"{name} must be finite and >= {lo}, got {v!r}")
    return v


@register_policy
class LFUDecay(EvictionPolicy):
    """LFU with exponential aging: a use at access ``t`` weighs ``2**((t - now) / half_life)``.

    The score of a slot is ``log2(sum of counts * 2**(t / half_life))`` over its uses,
    which orders slots by their decayed count at any common time and never overflows.
    Rows used fewer than ``admit`` times since entering the cache tiers are *on
    probation* and evicted before every admitted row (a frequency admission filter).
    Scores and use counts move with rows between tiers.

    Args:
        half_life: accesses after which a use counts half (large = LFU, small = LRU).
        admit: uses needed to leave probation (1 = no filter).
    """

    name = "lfu_decay"
    code = _pk.LFU_DECAY

    @staticmethod
    def tune_grid(accesses: int) -> list[dict]:
        """Half-lives of 0.3%, 3% and 30% of the trace, with and without admission."""
        return [{"half_life": float(max(1.0, round(accesses * f))), "admit": a} for f in (0.003, 0.03, 0.3)
                for a in (1, 2)]

    def __init__(self, capacity: int, device: torch.device | str = "cpu", half_life: float = 100_000.0,
                 admit: int = 1, admission: str = "off"):
        self.half_life = float(_number("half_life", half_life, 1e-9))
        self.admit = int(_number("admit", admit, 1, integer=True))
        super().__init__(capacity, device, admission)

    def _params(self) -> list[float]:
        return [float(self.code), self.half_life, float(self.admit), 0.0]

    @property
    def score(self) -> torch.Tensor:
        return torch.from_numpy(self._score)


class QueuePolicy(EvictionPolicy):
    """A policy whose victims come from queues over the slots (:mod:`hiermem.core.queues`):
    the state tuple's heap arrays hold the lists, ghosts and sketch, ``score`` a per-slot
    count, ``uses`` each row's hash; the reservoir is not used."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu", admission: str = "off", **params: Any):
        self._qparams = params
        super().__init__(capacity, device, admission)
        C = self.capacity
        nhk, nhs = _qk.layout(self.code, C, params)
        rm = np.zeros(_names.RM_ALL, dtype=np.int64)
        hk = np.empty(max(1, nhk), dtype=np.int64)
        hs = np.zeros(max(1, nhs), dtype=np.int64)
        st = list(self.state)
        st[_names.P_RM], st[_names.P_HEAP_K], st[_names.P_HEAP_S] = rm, hk, hs
        st[_names.P_RUN_S] = st[_names.P_RUN_K] = st[_names.P_SCRATCH_K] = st[_names.P_SCRATCH_S] = np.empty(
            1, dtype=np.int64)
        self.state = tuple(st)
        _qk.init_state(self.code, C, params, rm, hk, hs)

    def on_lookahead(self, slots, next_use=None) -> None:
        """Only as lookahead's base (``Lookahead(base=...)``): the rows in ``slots`` are
        next used ``next_use`` batches ahead; the queues pass over them until no other
        row is left, then the furthest goes first."""
        if self.wants_lookahead:
            s = as_array(slots)
            nxt = np.ones(s.size, dtype=np.int64) if next_use is None else as_array(next_use)
            _qk.lookahead_marks(self.state, s, nxt)

    @property
    def reservoir(self) -> bool:
        return False

    @reservoir.setter
    def reservoir(self, on: bool) -> None:  # nothing to switch: the lists are exact
        pass

    def reset(self) -> None:
        st = self.state
        _qk.init_state(self.code, self.capacity, self._qparams, st[_names.P_RM], st[_names.P_HEAP_K],
                       st[_names.P_HEAP_S])
        if self.code == _names.ARC:
            st[_names.P_PARAMS][1] = 0.0  # p
        if self.wants_lookahead:  # lookahead's base
            st[_names.P_RM][_names.Q_LA] = 1
        self._reset_admission()  # (init_state zeroed its region with the rest of hs)

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """``n`` slots to evict, in the order the policy evicts them, among the slots of
        the bool mask ``evictable`` (the policy's state moves as it would: second chances
        given, ghosts entered).

        Raises:
            InvalidArgumentError: fewer than ``n`` slots are evictable.
        """
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        ev = as_array(evictable, np.bool_)
        out = np.empty(n, dtype=np.int64)
        got = _qk.victims_of(self.state, np.zeros(self.capacity, np.int64), (~ev).astype(np.int32),
                             np.zeros(self.capacity, np.uint8), n, out)
        if got < n:
            raise InvalidArgumentError(f"need {n} victims, only {got} evictable")
        return torch.from_numpy(out)

    def check_reservoir(self, occupied) -> None:
        st = self.state
        assert _qk.check(st[_names.P_RM], st[_names.P_HEAP_K], np.zeros(1, np.int64)), f"{self.name}: lists broken"


def _ratio(name: str, v, lo: float, hi: float) -> float:
    v = float(_number(name, v, lo))
    if v >= hi:
        raise InvalidArgumentError(f"{name} must be < {hi}, got {v!r}")
    return v


@register_policy
class Sieve(QueuePolicy):
    """SIEVE (Zhang et al., NSDI'24): a FIFO queue with a visited bit and a moving hand.

    A hit sets the row's visited bit.  To evict, the hand walks from where it stopped
    toward newer rows (from the oldest when it has none), clearing visited bits, and
    evicts the first row not visited.  Rows are never moved on a hit.
    """

    name = "sieve"
    code = _names.SIEVE

    def __init__(self, capacity: int, device: torch.device | str = "cpu", admission: str = "off"):
        super().__init__(capacity, device, admission)


@register_policy
class S3FIFO(QueuePolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

    New rows enter the small queue (the main one when their id is in the ghost).  A row
    leaving the small queue moves to main if it was used ``threshold`` times there, else
    it is evicted and its id enters the ghost; main is a FIFO with a 2-bit clock.

    Args:
        small: the small queue's share of the slots.
        ghost: the ghost's size, as a share of the slots.
        threshold: uses in the small queue that move a row to main.
    """

    name = "s3fifo"
    code = _names.S3FIFO

    @staticmethod
    def tune_grid(accesses: int) -> list[dict]:
        return [{"small": f} for f in (0.05, 0.10, 0.20)]

    def __init__(self, capacity: int, device: torch.device | str = "cpu", small: float = 0.10, ghost: float = 0.90,
                 threshold: int = 2, admission: str = "off"):
        small = _ratio("small", small, 0.0, 1.0)
        ghost = float(_number("ghost", ghost, 0.0))
        threshold = int(_number("threshold", threshold, 1, integer=True))
        if threshold != 2:
            raise InvalidArgumentError("threshold: only 2 (libCacheSim's default) is compiled")
        self.small, self.ghost, self.threshold = small, ghost, threshold
        super().__init__(capacity, device, admission, small=small, ghost=ghost)

    def _params(self) -> list[float]:
        return [float(self.code), self.small, self.ghost, float(self.threshold)]


@register_policy
class ARCPolicy(QueuePolicy):
    """ARC (Megiddo & Modha, FAST'03): recency (T1) and frequency (T2) LRU lists whose
    split ``p`` adapts to hits in their ghosts (B1, B2)."""

    name = "arc"
    code = _names.ARC

    def __init__(self, capacity: int, device: torch.device | str = "cpu", admission: str = "off"):
        super().__init__(capacity, device, admission)


@register_policy
class WTinyLFU(QueuePolicy):
    """W-TinyLFU (Einziger et al., as Caffeine): a window LRU in front of a segmented
    LRU main cache, with a count-min sketch deciding, when the cache is full, whether the
    window's oldest row or main's victim stays.

    Args:
        window: the window's share of the slots (Caffeine and libCacheSim: 1%).
    """

    name = "wtinylfu"
    code = _names.WTINYLFU

    @staticmethod
    def tune_grid(accesses: int) -> list[dict]:
        return [{"window": f} for f in (0.01, 0.10)]

    def __init__(self, capacity: int, device: torch.device | str = "cpu", window: float = 0.01,
                 admission: str = "off"):
        self.window_share = _ratio("window", window, 0.0, 1.0)
        super().__init__(capacity, device, admission, window=self.window_share)

    def _params(self) -> list[float]:
        return [float(self.code), self.window_share, 0.0, 0.0]


_LOOKAHEAD_BASES = {"lru": _names.LRU, "lfu": _names.LFU, "lfu_decay": _names.LFU_DECAY}
_QUEUE_BASES = ("sieve", "s3fifo", "arc", "wtinylfu")


@register_policy
class Lookahead(EvictionPolicy):
    """An oracle within its window: evict first the rows no batch of the next ``window``
    uses (in the order of the ``base`` policy), then the rows used in the window, the one
    whose next use is furthest first (Belady's rule inside the window; ties by the base
    key's recency bits).

    The prefetch pipeline (and the simulator, which knows the trace) tell it before each
    placement which resident rows the next ``window`` batches use and how many batches
    ahead (:meth:`on_lookahead`).  Without lookahead calls it is its base policy.  A
    window covering the whole trace is Belady's MIN (demand paging: the missed row always
    enters).  The window (in batches) is independent of the prefetch depth.

    Args:
        window: batches to look ahead; 0 means the prefetch depth of the run.
        base: the order outside the window: ``"lru"``, ``"lfu"``, ``"lfu_decay"`` (keys:
            the window's rows get keys above every base key), or a queue policy,
            ``"sieve"``, ``"s3fifo"``, ``"arc"``, ``"wtinylfu"`` (with its defaults: its
            queues pass over the window's rows until no other row is left; then the
            furthest next use goes first).  Built as that policy with lookahead on.
        half_life, admit: ``lfu_decay``'s, when it is the base.
        admission: the admission filter (any base).
    """

    def __new__(cls, capacity: int, device: torch.device | str = "cpu", window: int = 0, base: str = "lru",
                admission: str = "off", **params: Any):
        if base not in _QUEUE_BASES:
            return super().__new__(cls)
        if params:
            raise PolicyFileError(f"lookahead over {base!r} takes no parameters {sorted(params)} (its defaults)")
        pol = POLICIES[base](capacity, device, admission=admission)
        pol.wants_lookahead = True
        pol.window = int(_number("window", window, 0, integer=True))
        pol.base = base
        pol.name = cls.name
        pol.state[_names.P_RM][_names.Q_LA] = 1
        return pol

    name = "lookahead"
    code = _pk.LOOKAHEAD
    wants_lookahead = True

    @staticmethod
    def tune_grid(accesses: int) -> list[dict]:
        """Windows of 0 (the prefetch depth), 2, 8 and 32 batches over LRU, and 8 over
        lfu_decay (half-life 3% of the trace)."""
        return [{"window": w} for w in (0, 2, 8, 32)] + [
            {"window": 8, "base": "lfu_decay", "half_life": float(max(1.0, round(accesses * 0.03)))}]

    def __init__(self, capacity: int, device: torch.device | str = "cpu", window: int = 0, base: str = "lru",
                 half_life: float = 100_000.0, admit: int = 1, admission: str = "off"):
        self.window = int(_number("window", window, 0, integer=True))
        if base not in _LOOKAHEAD_BASES:
            raise InvalidArgumentError(f"base must be one of {sorted(_LOOKAHEAD_BASES) + list(_QUEUE_BASES)}, "
                                       f"got {base!r}")
        self.base = base
        self.half_life = float(_number("half_life", half_life, 1e-9))
        self.admit = int(_number("admit", admit, 1, integer=True))
        super().__init__(capacity, device, admission)
        st = list(self.state)  # base keys and next uses per slot (the reservoir is not used)
        C = self.capacity
        st[_names.P_HEAP_K] = np.zeros(max(C, st[_names.P_HEAP_K].size), dtype=np.int64)
        st[_names.P_HEAP_S] = np.full(max(C, st[_names.P_HEAP_S].size), -1, dtype=np.int64)
        self.state = tuple(st)

    def _params(self) -> list[float]:
        return [float(self.code), self.half_life, float(self.admit), float(_LOOKAHEAD_BASES[self.base])]

    def on_lookahead(self, slots, next_use=None) -> None:
        """The rows in ``slots`` are used by the window's batches, next ``next_use``
        batches ahead (int64 per slot; None: all alike); replaces the last call's set."""
        s = as_array(slots)
        nxt = np.zeros(s.size, dtype=np.int64) if next_use is None else as_array(next_use)
        _pk.lookahead_keys(self.state, s, nxt)

    def on_carry_in(self, slots, carried) -> None:
        super().on_carry_in(slots, carried)
        c = as_array(carried, np.float64)
        _pk.lookahead_carry(self.state, as_array(slots), np.ascontiguousarray(c[:, 0]).view(np.int64))
