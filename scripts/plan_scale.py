"""Plan the paper's scale: 128 ranks (16 hosts x 8), 1,000 tables, ~10^12 parameters.

    python scripts/plan_scale.py [--tables 1000] [--params 1e12] [--device-gb 16]

Tables are synthetic but shaped like production ones (log-uniform rows, dims 32..256,
pooling factors 1..60, Zipf skews 0.8..1.3), scaled so their parameters add up to
``--params``.  Device memory per rank defaults to 16 GB so most tables cannot stay whole
in HBM and the planner must pick row/column sharding and cached/SSD tiers.  Prints the
plan summary and its first tables; the last line is JSON (with the planning seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hiermem as hm  # noqa: E402
from hiermem.sharding import PlannerTable, Topology, plan  # noqa: E402
from hiermem.sharding.config import format_plan, summary  # noqa: E402


def tables(n: int, params: float, seed: int = 0) -> list[PlannerTable]:
    rng = np.random.default_rng(seed)
    dims = rng.choice([32, 64, 128, 256], size=n, p=[0.3, 0.35, 0.25, 0.1])
    rows = 10 ** rng.uniform(3, 9, size=n)
    rows *= params / float((rows * dims).sum())
    pf = rng.uniform(1, 60, size=n).round(1)
    alpha = rng.uniform(0.8, 1.3, size=n).round(3)
    return [PlannerTable(f"t{i:04d}", max(1, int(r)), int(d), float(p), float(a))
            for i, (r, d, p, a) in enumerate(zip(rows, dims, pf, alpha))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=1000)
    ap.add_argument("--params", type=float, default=1e12)
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--device-gb", type=float, default=16.0)
    ap.add_argument("--host-gb", type=float, default=128.0)
    ap.add_argument("--ssd-gb", type=float, default=2000.0)
    ap.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    a = ap.parse_args()
    tabs = tables(a.tables, a.params)
    topo = Topology(a.hosts * a.ranks_per_host, a.ranks_per_host, device_bytes=a.device_gb * 1e9,
                    host_bytes=a.host_gb * 1e9, ssd_bytes=a.ssd_gb * 1e9)
    t0 = time.perf_counter()
    p = plan(tabs, topo, a.batch, hm.RowWiseAdagrad())
    secs = time.perf_counter() - t0
    total = sum(t.num_rows * t.dim for t in tabs)
    print(format_plan(p, max_tables=15).split("\n\nrank")[0])
    s = summary(p)
    print(f"\n{len(tabs)} tables, {total:.3g} parameters, {topo.world_size} ranks ({a.hosts} hosts x "
          f"{a.ranks_per_host}); planned in {secs:.1f} s")
    print(f"shardings {s['shardings']}; shard tiers {s['tiers']}")
    print(f"estimated step: slowest rank {s['max_rank_ms']:.3f} ms, fastest {s['min_rank_ms']:.3f} ms; "
          f"max per rank: device {s['max_device_bytes'] / 1e9:.2f} GB of {a.device_gb}, host "
          f"{s['max_host_bytes'] / 1e9:.1f} GB of {a.host_gb}, ssd {s['max_ssd_bytes'] / 1e9:.1f} GB of {a.ssd_gb}")
    print(json.dumps({"plan_seconds": round(secs, 2), "tables": len(tabs), "parameters": total,
                      "world_size": topo.world_size, **s}))


if __name__ == "__main__":
    main()
