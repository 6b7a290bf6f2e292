"""Runs the control plane's kernels over random batches and prints every plan's digest.

``tests/test_core_parity.py`` runs it twice, compiled and with ``NUMBA_DISABLE_JIT=1``,
and compares the outputs: the same plans, victims, keys and counters, per policy, with
pins, unaccounted placements, lookahead marks and a compiled replay, with the admission
filter off or on.

    python tests/parity_driver.py POLICY SEED [ADMISSION]
"""

from __future__ import annotations

import hashlib
import warnings
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.core import plan as P  # noqa: E402
from hiermem.core.names import RH, RM_SIZE  # noqa: E402
from hiermem.core.sketch import row_hashes  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)  # interpreted kernels: int64 hashing wraps
from hiermem.core.index import KeyIndex  # noqa: E402
from hiermem.core.replay import replay  # noqa: E402
from hiermem.core.policies import PolicySpec, resolve_policy  # noqa: E402
from hiermem.tiers.slots import SlotTier  # noqa: E402
from hiermem.types import Tier  # noqa: E402


def run(policy: str, seed: int, admission: str = "off") -> dict:
    rng = np.random.default_rng(seed)
    spec = PolicySpec(resolve_policy(policy).name, {"admission": admission})
    D, H, T = 120, 5000, 2
    ix = KeyIndex(D + H, [None, None] if seed % 2 else [3000, 3000])
    dev = SlotTier(Tier.DEVICE, D, 0, "cpu", spec, base=0)
    host = SlotTier(Tier.HOST, H, 0, "cpu", spec, base=D)
    for tier in (dev, host):  # small tiers: make the reservoir answer anyway (its fields only: a queue
        tier.policy.state[4][:RM_SIZE] = 0  # policy's lists live past them)
    counters = np.zeros((T, 3, 5), dtype=np.int64)
    h = hashlib.sha256()
    clock = 0
    statuses = []
    for step in range(80):
        n = int(rng.integers(1, 90))
        bt = rng.integers(0, T, n)
        bk = rng.zipf(1.3, n) % 3000
        key = np.unique(bt * 10_000 + bk)
        bt, bk = key // 10_000, key % 10_000
        U = bk.size
        ws, res = P.workspace(U)
        row_hashes(bt, bk, ws[RH, :U])  # the store's backing's row hashes
        if policy == "lookahead" and step % 3 == 0:
            for tier in (dev, host):
                occ = np.nonzero(tier.state[0] >= 0)[0]
                tier.policy.on_lookahead(occ[rng.random(occ.size) < 0.3])
        P.decide(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk, ws, res)
        statuses.append(int(res[P.STATUS]))
        if res[P.STATUS] == P.CAPACITY:
            continue
        nd = int(res[P.N_DISK])
        ws[P.FOUND, :nd] = rng.integers(0, 2, nd)
        account = bool(step % 5)
        cl = (clock + rng.permutation(U)).astype(np.int64) if account else np.full(U, clock, np.int64)
        counts = rng.integers(1, 4, U)
        P.commit(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk, cl, counts,
                 account, ws, res, counters)
        clock += U + 10
        parts = [ws[P.SLOT, :U], ws[P.ONDEV, :U], ws[P.MOVED, :U], ws[P.VD, :res[P.N_VD]], ws[P.VH, :res[P.N_VH]],
                 ws[P.UP_SRC, :res[P.N_UP]], ws[P.UP_DST, :res[P.N_UP]], ws[P.DN_SRC, :res[P.N_DN]],
                 ws[P.DN_DST, :res[P.N_DN]], ws[P.NEW_DST, :nd], ws[P.WB, :res[P.N_WB]], res,
                 dev.policy.state[0], host.policy.state[0], dev.state[0], host.state[0], dev.state[4], host.state[4]]
        for a in parts:
            h.update(np.ascontiguousarray(a).tobytes())
        if step % 4 == 0:  # pin and unpin rows where they are
            g = ix.find(bt, bk).numpy()
            on = g < D
            for tier, s in ((dev, g[on]), (host, g[~on] - D)):
                tier.pin(s, 1 if step % 8 == 0 else 0)
        if step % 8 == 4:
            for tier in (dev, host):
                tier.pin(np.nonzero(tier.state[3] > 0)[0], -1)
        if step % 6 == 0:
            for tier in (dev, host):
                tier.state[2][rng.integers(0, tier.capacity, 20)] = tier.state[0][0] >= 0
    # and the compiled replay of a per-access stream
    rows = rng.zipf(1.2, 3000) % 700
    dv, hs = SlotTier(Tier.DEVICE, 50, 0, "cpu", spec, base=0), SlotTier(Tier.HOST, 100, 0, "cpu", spec, base=50)
    rix = KeyIndex(150, [700], direct=True)
    written = np.zeros(700, dtype=np.uint8)
    rhash = np.empty(700, dtype=np.int64)
    row_hashes(np.zeros(700, dtype=np.int64), np.arange(700, dtype=np.int64), rhash)
    rc = np.zeros((1, 3, 5), dtype=np.int64)
    io = np.zeros(16, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(rng.integers(1, 4, 3000))))
    offsets = offsets[offsets <= rows.size]
    end = replay(rix.arrays, dv.state, dv.policy.state, hs.state, hs.policy.state, rows, offsets,
                 np.zeros(700, dtype=np.int64), np.zeros(1, dtype=np.int64), rhash, written, True, rc, io, 8,
                 *P.workspace(8), 0)
    return {"digest": h.hexdigest(), "counters": counters.tolist(), "statuses": statuses,
            "replay": [int(end), rc.tolist(), io.tolist(), written.tolist(), dv.policy.state[0].tolist()]}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])))
