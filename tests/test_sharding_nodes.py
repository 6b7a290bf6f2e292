"""Two nodes on one machine: two ``torchrun`` launchers (``--nnodes 2``, node ranks 0 and 1,
c10d rendezvous on 127.0.0.1, two processes each) train the sharded DLRM of
``scripts/train_sharded.py``; every step's loss and the final rows equal the unsharded
single-process run on the same global batch (``--reference 4``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hiermem.sharding.dist import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts" / "train_sharded.py")
STEPS = 8


def _mixed_plan(path: Path) -> Path:
    """Every sharding type once (RW across the nodes, TWRW within one), caches smaller than the tables."""
    import hiermem as hm
    from hiermem.sharding import ShardingType as S
    from hiermem.sharding import Topology, plan

    sys.path.insert(0, str(ROOT / "scripts"))
    from train_sharded import TABLES

    allowed = {"user": (S.ROW_WISE,), "item": (S.TABLE_ROW_WISE,), "ctx": (S.COLUMN_WISE,),
               "cat": (S.DATA_PARALLEL,), "geo": (S.TABLE_WISE,)}
    p = plan(TABLES, Topology(4, 2, device_bytes=400_000, host_bytes=4e6), 64, hm.RowWiseAdagrad(lr=0.05),
             allowed=allowed)
    assert {t.sharding for t in p.tables} == set(S)
    path.write_text(p.to_json())
    return path


def _launcher(node: int, port: int, out: Path, path: Path, plan_json: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "hiermem-two-nodes", "--rdzv-conf", f"is_host={int(node == 0)}",
           "--max-restarts", "0", "--local-addr", "127.0.0.1",
           SCRIPT, "--steps", str(STEPS), "--ranks-per-host", "2", "--path", str(path), "--out", str(out),
           "--plan", str(plan_json)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_torchrun_nodes_train_like_one_process(tmp_path):
    port = free_port()
    pj = _mixed_plan(tmp_path / "plan.json")
    procs = [_launcher(n, port, tmp_path / f"out{n}", tmp_path / f"node{n}", pj) for n in (0, 1)]
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two launchers did not finish in 600 s")
        outs.append((p.returncode, so, se))
    for rc, so, se in outs:
        assert rc == 0, se[-4000:]
    # global rank 0 lives on one of the two launchers: its result file is the one written
    res = [json.loads((tmp_path / f"out{n}" / "result.json").read_text()) for n in (0, 1)
           if (tmp_path / f"out{n}" / "result.json").exists()]
    assert len(res) == 1
    got = res[0]
    assert got["world_size"] == 4 and len(got["losses"]) == STEPS
    last = json.loads(next(o[1] for o in outs if o[1].strip()).strip().splitlines()[-1])
    assert sorted(last["shardings"].values()) == ["CW", "DP", "RW", "TW", "TWRW"]
    # each node's two ranks keep their stores under that node's --path
    ranks = [sorted(p.name for p in (tmp_path / f"node{n}").iterdir()) for n in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == ["rank0", "rank1", "rank2", "rank3"] and len(ranks[0]) == 2, ranks
    ref_dir = tmp_path / "ref"
    r = subprocess.run([sys.executable, SCRIPT, "--reference", "4", "--steps", str(STEPS), "--path", str(ref_dir),
                        "--out", str(ref_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want = json.loads((ref_dir / "result.json").read_text())
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"step {step}: loss {a} vs the single process's {b}"
    assert want["losses"][-1] < want["losses"][0]
    import torch

    for name, rows in want["rows"].items():
        torch.testing.assert_close(torch.tensor(got["rows"][name]), torch.tensor(rows), rtol=1e-5, atol=1e-5,
                                   msg=lambda s: f"table {name}: {s}")
