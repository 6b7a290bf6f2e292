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

from .core import policy as _pk
from .errors import InvalidArgumentError, InvalidTypeError
from .eviction import EvictionPolicy, register_policy


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

    def __init__(self, capacity: int, device: torch.device | str = "cpu", half_life: float = 100_000.0,
                 admit: int = 1):
        self.half_life = float(_number("half_life", half_life, 1e-9))
        self.admit = int(_number("admit", admit, 1, integer=True))
        super().__init__(capacity, device)

    def _params(self) -> list[float]:
        return [float(self.code), self.half_life, float(self.admit), 0.0]

    @property
    def score(self) -> torch.Tensor:
        return torch.from_numpy(self._score)


@register_policy
class Lookahead(EvictionPolicy):
    """Evict first the rows not used by the next ``window`` batches, LRU among equals.

    The key is ``last_clock | SOON`` where ``SOON`` (bit 62) marks the slots named by the
    last :meth:`on_lookahead` call.  Without lookahead calls it is exact LRU.

    Args:
        window: batches to look ahead; 0 means the prefetch depth of the run.
    """

    name = "lookahead"
    code = _pk.LOOKAHEAD
    wants_lookahead = True

    def __init__(self, capacity: int, device: torch.device | str = "cpu", window: int = 0):
        self.window = int(_number("window", window, 0, integer=True))
        super().__init__(capacity, device)
