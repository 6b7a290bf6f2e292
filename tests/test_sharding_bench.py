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
