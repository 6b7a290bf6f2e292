"""The admission filter: TinyLFU in front of any eviction policy's device tier.

With ``admission="tinylfu"`` (a parameter every policy takes,
:class:`hiermem.core.policies.EvictionPolicy`) a count-min sketch
(:mod:`hiermem.core.sketch`) counts the accesses of the device tier, every distinct row
of an accounted batch once.  When a batch must evict from the full device tier, each
row entering it (from the host or from disk) is admitted only if its estimate beats the
largest estimate among that batch's device victims (FBGEMM's LFU insert rule, TinyLFU's
admission).  A refused row is still placed where the plan put it, so the batch is served
as it would be; it is only put *on probation*: the first victim of the next eviction
(:func:`hiermem.core.policy.probation`), until it is used again, which admits it.  So a
stream of one-hit wonders churns the probation rows, not the rows that are used.  (A
key policy's refused row that is evicted to the host carries its key there, so it is
the host's first victim too; a queue policy's enters the host's queues as any row.)

The decision is made in the placement's commit (:func:`hiermem.core.plan.commit_`), the
one the store, the pipeline and the simulator share, over the store's row hashes
(``ws[RH]``), so a simulation refuses the same rows as the store.

The filter's state is part of the device tier's policy: fields ``A_*`` of ``rm``
(:mod:`hiermem.core.names`) and a region of ``hs`` past the policy's own use of it:
each slot's row hash (``C`` int64 at ``rm[A_HASH]``, set as rows enter) and the sketch
(``ROWS x rm[A_W]`` counts at ``rm[A_SK]``), halved every ``rm[A_SAMPLE]`` (10 x the
tier's slots, Caffeine's period) increments.  The host tier's policy has none.
"""

from __future__ import annotations

import numpy as np

from . import sketch as _sk
from .jit import helper, tiny
from .names import A_ADDS, A_HASH, A_ON, A_SAMPLE, A_SK, A_W, ADMIT_OFF, ADMIT_TINYLFU

#: the ``admission`` values a policy takes, and their codes (``rm[A_ON]``)
ADMISSIONS = {"off": ADMIT_OFF, "tinylfu": ADMIT_TINYLFU}
COUNTS_PER_SLOT = 4  # per sketch row: 16 counts a slot in all, as Caffeine's
SAMPLE_PER_SLOT = 10  # increments per slot between two halvings


def size(capacity: int) -> int:
    """int64 entries of the filter's region for a tier of ``capacity`` slots."""
    C = max(1, int(capacity))
    return C + _sk.ROWS * _sk.width(C, COUNTS_PER_SLOT)


def init(rm: np.ndarray, hs: np.ndarray, off: int, capacity: int, code: int) -> None:
    """An empty filter (``code``: ``ADMISSIONS``'s) in ``hs[off:off + size(capacity)]``."""
    C = max(1, int(capacity))
    rm[A_ON] = code
    rm[A_HASH], rm[A_SK], rm[A_W] = off, off + C, _sk.width(C, COUNTS_PER_SLOT)
    rm[A_ADDS], rm[A_SAMPLE] = 0, SAMPLE_PER_SLOT * C
    hs[off:off + size(C)] = 0


@helper
def estimate(rm, hs, h):
    """The sketch's count of row hash ``h``."""
    return _sk.estimate(hs, rm[A_SK], rm[A_W], h)


@helper
def record(rm, hs, h):
    """One access of row hash ``h`` (every count halved each ``rm[A_SAMPLE]`` of them)."""
    _sk.increment(hs, rm[A_SK], rm[A_W], h)
    rm[A_ADDS] += 1
    if rm[A_ADDS] >= rm[A_SAMPLE]:
        rm[A_ADDS] = 0
        _sk.halve(hs, rm[A_SK], rm[A_W])


@helper
def record_batch(rm, hs, rh, n):
    """An accounted batch's distinct rows (hashes ``rh[:n]``), one access each."""
    for i in range(n):
        record(rm, hs, rh[i])


@tiny
def slot_hash(rm, hs, s):
    """The hash of the row in slot ``s``."""
    return hs[rm[A_HASH] + s]


@tiny
def set_slot_hash(rm, hs, s, h):
    hs[rm[A_HASH] + s] = h


@helper
def victims_max(rm, hs, vd, n):
    """The largest estimate among the rows in slots ``vd[:n]`` (a batch's device victims,
    read before their slots are reused)."""
    m = np.int64(-1)
    for j in range(n):
        m = max(m, estimate(rm, hs, hs[rm[A_HASH] + vd[j]]))
    return m
