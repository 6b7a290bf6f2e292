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
