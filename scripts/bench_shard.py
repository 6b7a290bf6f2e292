"""Step time of the planner's plan vs all-TW and all-RW plans, on world size 2 (gloo).

    PYTHONPATH=. python scripts/bench_shard.py [--quick] [--steps N] [--rounds R]

One launch of 2 local ranks: calibrates the cost model on this machine (store throughput
and call overhead, gloo latency and all-to-all bandwidth), plans the workload with it,
builds the naive all-TW and all-RW plans (same tier logic), then trains all three
interleaved (median of R rounds of N steps, slowest rank).  Prints measured and estimated
ms; the last line is JSON with ``planner_over_best_naive`` (planner step time / best
naive step time; target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.sharding import launch_local  # noqa: E402
from hiermem.sharding.calibrate import bench_worker  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (< 60 s)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    a = ap.parse_args()
    steps = a.steps or (5 if a.quick else 20)
    rounds = a.rounds or (5 if a.quick else 9)
    with tempfile.TemporaryDirectory(prefix="hiermem-bench-shard-") as d:
        launch_local(2, bench_worker, d, ("planner", "TW", "RW"), steps, rounds)
        r = json.loads(Path(d, "result.json").read_text())
    t = r["topology"]
    print(f"calibrated: store {t['device_bw'] / 1e9:.2f} GB/s, call overhead {t['call_overhead_s'] * 1e6:.0f} us, "
          f"all-to-all {t['intra_host_bw'] / 1e9:.2f} GB/s, collective latency {t['collective_latency_s'] * 1e6:.0f} us, "
          f"ranks running at once {t['concurrency']:.2f} of 2")
    r["plans"] = {{"TW": "all-TW", "RW": "all-RW"}.get(n, n): v for n, v in r["plans"].items()}
    for n, v in r["plans"].items():
        print(f"{n:<8} measured {v['measured_ms']:8.2f} ms  estimated {v['estimated_ms']:8.2f} ms  {v['shardings']}")
    best_naive = min(r["plans"][n]["measured_ms"] for n in ("all-TW", "all-RW"))
    ratio = r["plans"]["planner"]["measured_ms"] / best_naive
    print(json.dumps({"world_size": 2, "steps": steps, "rounds": rounds,
                      **{f"{n}_ms": round(v["measured_ms"], 3) for n, v in r["plans"].items()},
                      **{f"{n}_est_ms": round(v["estimated_ms"], 3) for n, v in r["plans"].items()},
                      "planner_over_best_naive": round(ratio, 4), "target": 1.05, "met": ratio <= 1.05}))


if __name__ == "__main__":
    main()
