"""hiermem's planner vs TorchRec's planner vs the best uniform plan, measured on gloo (world 2).

    PYTHONPATH=. python scripts/bench_shard.py [--quick] [--steps N] [--rounds R]

The workload needs a planner: per-rank budgets of device and host bytes that one big
table exceeds on its own (it must be split), a hot wide table (compute-heavy), a long
tail of cold rows (belongs in a cached tier), and many tiny tables (per-shard overhead
dominates).  One run:

1. TorchRec's ``EmbeddingShardingPlanner`` plans the same tables (CPU topology, every
   rank's DDR = hiermem's device + host budget) and its plan is translated into a
   hiermem ``ShardingPlan`` (``hiermem.sharding.torchrec_plan``): "torchrec" keeps its
   shardings, ranks and column splits and fits every shard into the same per-rank
   budgets hiermem's planner had (fastest tier placement that fits, by hiermem's cost
   model); "torchrec-ddr" keeps every row in the device tier as TorchRec placed it
   (over the device budget: an advantage to TorchRec, reported for reference);
2. two local ranks calibrate the cost model on this machine, plan with hiermem's
   planner under the budgets, make every feasible uniform plan (all-TW, all-RW, all-CW,
   all-DP), and train every plan with ``ShardedEmbeddingBagCollection``, interleaved
   over R rounds of N steps (the slowest rank's step time per round).  ``--quick``
   skips uniform plans estimated at over twice the best uniform plan.

Ratios are per round (plans of one round run back to back), then median and spread
(min..max) over rounds.  The last line is JSON with ``planner_over_torchrec`` (vs the
budget-fit TorchRec plan; target <= 1.0; ``planner_over_torchrec_ddr`` vs the
unbudgeted one), ``planner_over_best_naive`` (best uniform = lowest median; target <= 0.95) and
``plan_types`` (distinct sharding types plus tiers in hiermem's plan; target >= 3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.sharding import PlannerTable, Topology, launch_local  # noqa: E402
from hiermem.sharding.calibrate import Workload, compare_worker  # noqa: E402

MB = 1e6
#: Per-rank budgets, no local SSD: "giant" (130 MB with its Adagrad state) exceeds one
#: rank's 120 MB, so it must be split (all-TW is infeasible).
DEVICE_BYTES, HOST_BYTES, SSD_BYTES = 24 * MB, 96 * MB, 0.0
WORKLOAD = Workload((
    PlannerTable("giant", 500_000, 64, 4.0, 0.8),  # larger than one rank's device + host
    PlannerTable("hot", 20_000, 128, 24.0, 0.6),  # hot and wide: most of the compute
    PlannerTable("tail", 600_000, 16, 2.0, 0.95),  # long cold tail, a few hot rows
    *(PlannerTable(f"tiny{i}", 500, 8, 1.0, 0.5) for i in range(16)),  # many tiny tables
), batch_size=256, per_table_skew=True)


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def _torchrec_plans(opt) -> tuple[dict[str, str], float]:
    """TorchRec's plan fit to hiermem's budgets ("torchrec") and as TorchRec placed it,
    every row in the device tier ("torchrec-ddr", over the device budget), as JSON."""
    from hiermem.sharding.torchrec_plan import fit_tiers, torchrec_plan

    t0 = time.perf_counter()
    topo = Topology(2, 2, device_bytes=DEVICE_BYTES, host_bytes=HOST_BYTES, ssd_bytes=SSD_BYTES)
    _, p = torchrec_plan(WORKLOAD.tables, topo, WORKLOAD.batch_size, opt)
    fit = fit_tiers(p, WORKLOAD.tables, topo, WORKLOAD.batch_size, opt)
    return {"torchrec": fit.to_json(), "torchrec-ddr": p.to_json()}, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (< 120 s)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    a = ap.parse_args()
    steps = a.steps or (6 if a.quick else 20)
    rounds = a.rounds or (7 if a.quick else 11)
    t_start = time.perf_counter()
    import logging

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    import hiermem as hm

    tr_json, tr_s = _torchrec_plans(hm.RowWiseAdagrad(lr=0.01))
    print(f"TorchRec's EmbeddingShardingPlanner: {tr_s:.1f} s (import and plan)", flush=True)
    with tempfile.TemporaryDirectory(prefix="hiermem-bench-shard-") as d:
        # --quick skips uniform plans estimated over 2x the best uniform one; a full run times all
        launch_local(2, compare_worker, d, WORKLOAD, (DEVICE_BYTES, HOST_BYTES, SSD_BYTES), tr_json,
                     steps, rounds, 2.0 if a.quick else float("inf"))
        r = json.loads(Path(d, "result.json").read_text())
    t = r["topology"]
    print(f"calibrated: store {t['device_bw'] / 1e9:.2f} GB/s (host tier {t['host_bw'] / 1e9:.2f} GB/s), "
          f"call overhead {t['call_overhead_s'] * 1e6:.0f} us, "
          f"all-to-all {t['intra_host_bw'] / 1e9:.2f} GB/s, "
          f"collective latency {t['collective_latency_s'] * 1e6:.0f} us, "
          f"ranks running at once {t['concurrency']:.2f} of 2")
    print(f"budgets per rank: device {DEVICE_BYTES / MB:.0f} MB, host {HOST_BYTES / MB:.0f} MB, "
          f"SSD {SSD_BYTES / MB:.0f} MB")
    plans = r["plans"]
    for n, why in r["infeasible"].items():
        print(f"{n:<9} infeasible: {why}")
    for n, v in plans.items():
        med = f"{statistics.median(v['rounds_ms']):8.2f}" if v["rounds_ms"] else "   (not timed: estimate > 2x best)"
        big = {k: f"{s}/{'+'.join(v['tiers'][k])}@{v['ranks'][k]}" for k, s in v["shardings"].items()
               if not k.startswith("tiny")}
        tiny = sorted({f"{s}@{v['ranks'][k]}" for k, s in v["shardings"].items() if k.startswith("tiny")})
        mem = " ".join(f"r{i}:{b['device'] / MB:.0f}/{b['host'] / MB:.0f}MB" for i, b in enumerate(v["rank_bytes"]))
        print(f"{n:<9} measured {med} ms  estimated {v['estimated_ms']:8.2f} ms  {big} tiny:{tiny}  dev/host {mem}")
        if v["rounds_ms"]:
            rest = statistics.median(v["rounds_ms"]) - v["store_ms"]
            e = v["estimated_parts_ms"]
            print(f"{'':<9} where the time goes: in the store (lookups + fused updates, slowest rank) "
                  f"{v['store_ms']:.2f} ms, the rest (collectives, split bookkeeping, waiting) {rest:.2f} ms; "
                  f"model, all ranks: compute {e['compute']:.1f} comm {e['comm']:.1f} prefetch {e['prefetch']:.1f} ms")
    timed = {n: v["rounds_ms"] for n, v in plans.items() if v["rounds_ms"]}
    naive = {n: x for n, x in timed.items() if n.startswith("all-")}
    best_naive = min(naive, key=lambda n: statistics.median(naive[n]))
    mine = timed["planner"]
    over_tr = [a / b for a, b in zip(mine, timed["torchrec"])]
    over_ddr = [a / b for a, b in zip(mine, timed["torchrec-ddr"])]
    over_naive = [a / b for a, b in zip(mine, naive[best_naive])]
    p = plans["planner"]
    kinds = sorted(set(p["shardings"].values()) | {x for ts in p["tiers"].values() for x in ts})
    res = {"world_size": 2, "steps": steps, "rounds": rounds,
           **{f"{n}_ms": round(statistics.median(x), 3) for n, x in timed.items()},
           **{f"{n}_store_ms": round(plans[n]["store_ms"], 3) for n in timed},
           "planner_over_torchrec": _spread(over_tr), "planner_over_best_naive": _spread(over_naive),
           "median_ratio_over_torchrec": round(statistics.median(mine) / statistics.median(timed["torchrec"]), 4),
           "planner_over_torchrec_ddr": _spread(over_ddr),
           "median_ratio_over_best_naive": round(statistics.median(mine) / statistics.median(naive[best_naive]), 4),
           "best_naive": best_naive, "plan_types": len(kinds), "plan_kinds": kinds,
           "seconds": round(time.perf_counter() - t_start, 1)}
    res["met"] = {"planner_over_torchrec": res["planner_over_torchrec"]["median"] <= 1.0,
                  "planner_over_best_naive": res["planner_over_best_naive"]["median"] <= 0.95,
                  "plan_types": len(kinds) >= 3}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
