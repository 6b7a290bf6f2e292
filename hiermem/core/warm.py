"""Compile every kernel once, when the cache holds none, with a one-line notice.

``import hiermem`` calls :func:`ensure_compiled`: with a warm cache it only checks a
stamp file (the kernels load lazily, on first use); on a fresh install it compiles
everything now (about half a minute), so the first batch of a training run is not the
one that waits.  ``NUMBA_DISABLE_JIT=1`` skips it.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from . import jit


def _exercise() -> None:
    """Call each kernel on tiny inputs of the types the store and simulator pass."""
    from ..eviction import PolicySpec
    from ..tiers.slots import SlotTier
    from ..types import Tier
    from . import index as ixk
    from . import plan as P
    from . import policy as pk
    from . import victims as vk
    from .index import KeyIndex
    from .replay import replay

    i64 = np.int64
    for sizes in ([50, 50], [None, None]):
        ix = KeyIndex(12, sizes)
        t, k = np.array([0, 1], dtype=i64), np.array([3, 4], dtype=i64)
        ix.insert(t, k, np.array([0, 5], dtype=i64))
        ix.find(t, k)
        ix.move_slots(np.array([0], dtype=i64), np.array([1], dtype=i64))
        ix.items()
        ix.remove_slots(np.array([1, 5], dtype=i64))
        ixk.rehash(ix.meta, ix.tab, ix.rev) if not ix.direct else None
        dev = SlotTier(Tier.DEVICE, 4, 0, "cpu", PolicySpec("lru"), base=0)
        host = SlotTier(Tier.HOST, 8, 0, "cpu", PolicySpec("lru"), base=4)
        counters = np.zeros((2, 3, 5), dtype=i64)
        ws, res = P.workspace(8)
        for step in range(3):
            bt = np.array([0, 0, 1, 1, 1], dtype=i64)
            bk = np.array([1, 2, 1, 2, 3 + step], dtype=i64)
            P.decide(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk, ws, res)
            P.commit(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk,
                     np.arange(5, dtype=i64), np.ones(5, dtype=i64), True, ws, res, counters)
        P.abort(dev.policy.state, host.policy.state)
        dev.pin(np.array([0], dtype=i64), 1)
        pol = dev.policy
        pk.access(pol.state, np.array([0], dtype=i64), np.array([9], dtype=i64), np.array([1], dtype=i64), False)
        pk.carry_in(pol.state, np.array([0], dtype=i64), np.array([9], dtype=i64), np.zeros(1), np.ones(1, dtype=i64))
        pk.lookahead_keys(pol.state, np.array([0], dtype=i64))
        out = np.empty(2, dtype=i64)
        vk.victims(pol.state, dev.state[0], dev.state[3], dev.state[6], 1, 3, 4, out)
        vk.scan(pol.state, dev.state[0], dev.state[3], dev.state[6], 1, out)
        vk.check(pol.state, dev.state[0])
    tix = KeyIndex(3, [5], direct=True)
    d2 = SlotTier(Tier.DEVICE, 2, 0, "cpu", PolicySpec("lru"), base=0)
    h2 = SlotTier(Tier.HOST, 1, 0, "cpu", PolicySpec("lru"), base=2)
    replay(tix.arrays, d2.state, d2.policy.state, h2.state, h2.policy.state, np.array([0, 1, 2, 3, 1], dtype=i64),
           np.array([0, 1, 3, 5], dtype=i64), np.zeros(5, dtype=i64), np.zeros(1, dtype=i64),
           np.zeros(5, dtype=np.uint8), True, np.zeros((1, 3, 5), dtype=i64), np.zeros(16, dtype=i64), 8,
           *P.workspace(4), 0)


def ensure_compiled(force: bool = False) -> float:
    """Compile the kernels unless the cache holds them; returns the seconds it took."""
    if jit.DISABLED or (jit.is_warm() and not force):
        return 0.0
    print("hiermem: compiling the control plane's kernels once (cached for later runs) ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    _exercise()
    jit.mark_warm()
    return time.perf_counter() - t0
