"""More eviction policies, registered in :data:`hiermem.eviction.POLICIES`:

* ``lfu_decay``: LFU whose counts decay exponentially with age (half-life in accesses),
  with an optional admission threshold.
* ``lookahead``: LRU that first evicts rows not used by the next ``window`` batches
  (Bagpipe's oracle cacher); it needs :meth:`EvictionPolicy.on_lookahead` calls.

Both keep the protocol's contract: one key per slot, victims are the smallest keys.
"""

from __future__ import annotations

import math

import torch

from .errors import InvalidArgumentError, InvalidTypeError
from .eviction import LRU, EvictionPolicy, register_policy

_PROBATION = float(2 ** 41)  # below any log2 score: clock / half_life < 2**40 for any clock we reach


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

    def __init__(self, capacity: int, device: torch.device | str = "cpu", half_life: float = 100_000.0,
                 admit: int = 1):
        super().__init__(capacity, device)
        self.half_life = float(_number("half_life", half_life, 1e-9))
        self.admit = int(_number("admit", admit, 1, integer=True))
        self.score = torch.zeros(self.capacity, dtype=torch.float64, device=device)
        self.uses = torch.zeros(self.capacity, dtype=torch.int64, device=device)
        self.key = torch.zeros(self.capacity, dtype=torch.float64, device=device)

    def _rekey(self, slots: torch.Tensor) -> None:
        s = self.score.index_select(0, slots)
        self.key[slots] = torch.where(self.uses.index_select(0, slots) < self.admit, s - _PROBATION, s)

    def _log_weight(self, clock: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return torch.log2(counts.to(torch.float64)) + clock.to(torch.float64) / self.half_life

    def on_access(self, slots, clock, counts):
        self.score[slots] = torch.logaddexp2(self.score.index_select(0, slots), self._log_weight(clock, counts))
        self.uses[slots] += counts
        self._rekey(slots)

    def on_insert(self, slots, clock, counts):
        self.score[slots] = self._log_weight(clock, counts)
        self.uses[slots] = counts
        self._rekey(slots)

    def carry(self, slots):
        return torch.stack((self.score.index_select(0, slots), self.uses.index_select(0, slots).to(torch.float64)), 1)

    def on_carry_in(self, slots, carried):
        self.score[slots] = carried[:, 0]
        self.uses[slots] = carried[:, 1].to(torch.int64)
        self._rekey(slots)


_SOON = 1 << 62  # key bit of rows needed by the next batches: evicted after all others


@register_policy
class Lookahead(LRU):
    """Evict first the rows not used by the next ``window`` batches, LRU among equals.

    The key is ``last_clock | SOON`` where ``SOON`` (bit 62) marks the slots named by the
    last :meth:`on_lookahead` call.  Without lookahead calls it is exact LRU.

    Args:
        window: batches to look ahead; 0 means the prefetch depth of the run.
    """

    name = "lookahead"
    wants_lookahead = True
    incremental = False  # on_lookahead rewrites every key

    def __init__(self, capacity: int, device: torch.device | str = "cpu", window: int = 0):
        super().__init__(capacity, device)
        self.window = int(_number("window", window, 0, integer=True))

    def on_access(self, slots, clock, counts):
        self.key[slots] = clock | (self.key.index_select(0, slots) & _SOON)

    def on_lookahead(self, slots: torch.Tensor) -> None:
        self.key &= _SOON - 1
        self.key[slots] |= _SOON
