"""Does the cost model order plans as their measured step times do?  World size 2, gloo.

    PYTHONPATH=. python scripts/bench_plan.py [--quick] [--plans planner,TW,RW,CW,DP]

One launch of 2 local ranks calibrates the cost model on this machine, makes each plan
(the planner's, and all-TW / all-RW / all-CW / all-DP with the same tier logic), trains
them interleaved and prints measured vs estimated ms per plan.  Orderings are compared
pairwise: a pair counts when the two estimates differ by more than ``--margin`` (closer
estimates are a tie the model does not claim to resolve); ``agree`` is true when every
such pair is ordered the same way by the measurements.  Last line: JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.sharding import launch_local  # noqa: E402
from hiermem.sharding.calibrate import bench_worker  # noqa: E402


def compare(plans: dict, margin: float) -> dict:
    """Pairwise order agreement of estimated and measured ms (pairs apart by > margin)."""
    pairs, agree = [], 0
    for a, b in itertools.combinations(sorted(plans), 2):
        ea, eb = plans[a]["estimated_ms"], plans[b]["estimated_ms"]
        if abs(ea - eb) <= margin * min(ea, eb):
            continue
        ma, mb = plans[a]["measured_ms"], plans[b]["measured_ms"]
        ok = (ea < eb) == (ma < mb)
        agree += ok
        pairs.append({"pair": [a, b], "estimated_faster": a if ea < eb else b,
                      "measured_faster": a if ma < mb else b, "agree": ok})
    est = sorted(plans, key=lambda n: plans[n]["estimated_ms"])
    mea = sorted(plans, key=lambda n: plans[n]["measured_ms"])
    return {"estimated_order": est, "measured_order": mea, "pairs_compared": len(pairs), "pairs_agree": agree,
            "agree": len(pairs) > 0 and agree == len(pairs), "pairs": pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (< 60 s)")
    ap.add_argument("--plans", default="planner,TW,RW,CW,DP")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--margin", type=float, default=0.10)
    a = ap.parse_args()
    names = tuple(a.plans.split(","))
    steps, rounds = a.steps or (3 if a.quick else 10), a.rounds or (3 if a.quick else 7)
    with tempfile.TemporaryDirectory(prefix="hiermem-bench-plan-") as d:
        launch_local(2, bench_worker, d, names, steps, rounds)
        r = json.loads(Path(d, "result.json").read_text())
    for n, v in r["plans"].items():
        print(f"{n:<8} measured {v['measured_ms']:8.2f} ms  estimated {v['estimated_ms']:8.2f} ms  "
              f"measured/estimated {v['measured_ms'] / v['estimated_ms']:.2f}")
    c = compare(r["plans"], a.margin)
    print(f"estimated order {c['estimated_order']}; measured order {c['measured_order']}; "
          f"{c['pairs_agree']}/{c['pairs_compared']} pairs (estimates > {a.margin:.0%} apart) agree")
    print(json.dumps({"world_size": 2, "steps": steps, "rounds": rounds, "margin": a.margin,
                      "measured_ms": {n: round(v["measured_ms"], 3) for n, v in r["plans"].items()},
                      "estimated_ms": {n: round(v["estimated_ms"], 3) for n, v in r["plans"].items()},
                      **{k: c[k] for k in ("estimated_order", "measured_order", "pairs_compared", "pairs_agree",
                                           "agree")}}))


if __name__ == "__main__":
    main()
