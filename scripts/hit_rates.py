"""Device hit rates of every policy and Belady's MIN on the shared traces, at device
capacities of 1%, 5% and 10% of the distinct ids (host tier = 2 x device).

    python scripts/hit_rates.py [--ml-batch 64] [--criteo-batch 8]

LRU, LFU and LFU-decay (half-life = 3% of the trace) run with plain lookups (k = 0); the
lookahead policy needs a pipeline, so it runs with prefetch depth 1 and a window of 8
batches, next to LRU at depth 1 as its baseline.  Belady is per access (the bound; every
batch here fits the smallest device).  Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.core.policies import PolicySpec  # noqa: E402
from hiermem.sim import SimConfig, import_criteo, import_movielens, load_trace, simulate  # noqa: E402
from hiermem.sim.bounds import belady_misses  # noqa: E402
from hiermem.sim.engine import dense_rows  # noqa: E402


def rates(path: Path) -> dict:
    tr = load_trace(path)
    dense = dense_rows(tr)[0]
    distinct = int(dense.max()) + 1
    runs = {"lru": (PolicySpec("lru"), 0), "lfu": (PolicySpec("lfu"), 0),
            "lfu_decay": (PolicySpec("lfu_decay", {"half_life": float(round(0.03 * tr.accesses))}), 0),
            "lru k=1": (PolicySpec("lru"), 1), "lookahead k=1": (PolicySpec("lookahead", {"window": 8}), 1)}
    out = {"accesses": tr.accesses, "distinct": distinct, "batches": tr.num_batches, "rates": {}}
    for frac in (0.01, 0.05, 0.10):
        cap = int(distinct * frac)
        row = {name: simulate(tr, SimConfig(cap, 2 * cap, spec, k)).hit_rate for name, (spec, k) in runs.items()}
        row["belady"] = 1 - belady_misses(dense, cap) / tr.accesses
        out["rates"][f"{int(frac * 100)}% ({cap} rows)"] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ml-batch", type=int, default=64, help="MovieLens ratings per batch")
    ap.add_argument("--criteo-batch", type=int, default=8, help="Criteo samples per batch (26 ids each)")
    a = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as td:
        res["movielens items"] = rates(import_movielens(Path(td) / "ml", a.ml_batch))
        res["criteo 26 tables"] = rates(import_criteo(Path(td) / "cr", a.criteo_batch))
    for name, r in res.items():
        print(f"\n{name}: {r['accesses']} accesses, {r['distinct']} distinct, {r['batches']} batches")
        cols = list(next(iter(r["rates"].values())))
        print(f"{'device':<16}" + "".join(f"{c:>15}" for c in cols))
        for cap, row in r["rates"].items():
            print(f"{cap:<16}" + "".join(f"{100 * row[c]:>14.2f}%" for c in cols))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
