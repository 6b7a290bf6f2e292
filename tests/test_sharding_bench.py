"""Bad input to the sharded module, and the plan benchmark machinery (not timed)."""

import json
import sys
from pathlib import Path

import hiermem as hm
import sharding_ref

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_plan import compare  # noqa: E402


def test_bad_input_and_bench_machinery(tmp_path):
    (tmp_path / "bench").mkdir()
    hm.launch_local(2, sharding_ref.bad_input_worker, str(tmp_path))
    r = json.loads((tmp_path / "bench" / "result.json").read_text())
    assert set(r["plans"]) == {"planner", "TW", "RW"}
    for v in r["plans"].values():
        assert v["measured_ms"] > 0 and v["estimated_ms"] > 0
    t = r["topology"]
    assert t["world_size"] == 2 and 1 <= t["concurrency"] <= 2 and t["call_overhead_s"] > 0
    c = compare(r["plans"], margin=0.0)
    assert c["pairs_compared"] >= 2 and sorted(c["estimated_order"]) == sorted(c["measured_order"])


def test_compare_orders():
    plans = {"a": {"estimated_ms": 1.0, "measured_ms": 10.0}, "b": {"estimated_ms": 2.0, "measured_ms": 20.0},
             "c": {"estimated_ms": 2.05, "measured_ms": 15.0}}
    c = compare(plans, margin=0.10)
    assert c["pairs_compared"] == 2 and c["agree"]  # b-c are within 10%: not compared
    plans["a"]["measured_ms"] = 30.0
    assert not compare(plans, margin=0.10)["agree"]


def test_torchrun_command_from_the_readme(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(root / "scripts" / "train_sharded.py"), "--steps", "3", "--path", str(tmp_path)],
                       capture_output=True, text=True, timeout=180, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["world_size"] == 2 and last["steps"] == 3 and last["last_loss"] < last["first_loss"]
    assert (tmp_path / "rank0").is_dir() and (tmp_path / "rank1").is_dir()


def test_planner_comparison_machinery(tmp_path):
    """bench_shard's worker end to end on a tiny workload (not timed): the planner's plan,
    every uniform plan (infeasible ones reported), an external plan (TorchRec's when
    torchrec is importable), per-round step times of each."""
    from hiermem.sharding import PlannerTable, ShardingType, Topology, naive_plan
    from hiermem.sharding.calibrate import Workload, compare_worker
    from hiermem.nn.torchrec import torchrec_available

    work = Workload((PlannerTable("big", 50_000, 16, 2.0, 0.8), PlannerTable("s0", 200, 8, 1.0, 0.5),
                     PlannerTable("s1", 300, 8, 1.0, 0.5)), batch_size=16, per_table_skew=True)
    budgets = (1e6, 2e6, 0.0)  # "big" (3.4 MB with Adagrad state) over one rank's 3 MB: no all-TW, no all-DP
    topo = Topology(2, 2, device_bytes=budgets[0], host_bytes=budgets[1], ssd_bytes=budgets[2])
    if torchrec_available():
        from hiermem.sharding.torchrec_plan import torchrec_plan

        ext = torchrec_plan(work.tables, topo, 16, hm.RowWiseAdagrad(lr=0.01))[1]
    else:
        ext = naive_plan(work.tables, topo, 16, ShardingType.ROW_WISE)
    hm.launch_local(2, compare_worker, str(tmp_path), work, budgets, {"external": ext.to_json()}, 1, 2)
    r = json.loads((tmp_path / "result.json").read_text())
    assert {"all-TW", "all-DP"} <= set(r["infeasible"]) and "does not fit" in r["infeasible"]["all-TW"]
    assert {"planner", "external", "all-RW"} <= set(r["plans"])
    for n in ("planner", "external", "all-RW"):
        v = r["plans"][n]
        assert len(v["rounds_ms"]) == 2 and all(x > 0 for x in v["rounds_ms"]) and v["estimated_ms"] > 0
    big = r["plans"]["planner"]
    assert big["shardings"]["big"] != "TW" and all(b["device"] <= budgets[0] for b in big["rank_bytes"])
