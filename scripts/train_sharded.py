"""Train a sharded embedding collection: under torchrun (one or many hosts) or locally.

    # one host, 2 ranks (gloo on CPU; NCCL is not wired yet, see README "Sharding")
    torchrun --standalone --nproc-per-node 2 scripts/train_sharded.py --steps 20
    # two hosts x 8 ranks: run on every host, with its --node-rank
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d \
        --rdzv-endpoint host0.example:29500 scripts/train_sharded.py --ranks-per-host 8 --path /ssd/hiermem
    # or without torchrun: 2 local processes
    python scripts/train_sharded.py --local 2

Every rank plans the same tables with the same inputs (so every rank gets the same
plan; ``--plan plan.json`` loads a saved one instead), builds its shards' store under
``--path/rank<r>``, and trains on synthetic skewed batches.  Rank 0 prints the plan and
the loss per step; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hiermem as hm  # noqa: E402
from hiermem.sharding import ShardingPlan, Topology, launch_local, plan  # noqa: E402
from hiermem.sharding.calibrate import BENCH_WORKLOAD  # noqa: E402
from hiermem.sharding.config import format_plan  # noqa: E402


def train(rank: int, world: int, a: argparse.Namespace) -> None:
    work = BENCH_WORKLOAD
    opt = hm.RowWiseAdagrad(lr=0.05)
    rph = min(a.ranks_per_host, world)
    p = ShardingPlan.from_json(Path(a.plan).read_text()) if a.plan else \
        plan(work.tables, Topology(world, rph, device_bytes=a.device_mb * 1e6), work.batch_size, opt)
    m = hm.ShardedEmbeddingBagCollection(work.specs(), p, hm.StoreConfig(Path(a.path), optimizer=opt))
    if rank == 0:
        print(format_plan(p), flush=True)
    dims = sum(t.dim for t in work.tables)
    losses = []
    for step in range(a.steps):
        out = m(work.batch(step, rank))
        target = torch.ones(work.batch_size, dims) * 0.1
        loss = ((out - target) ** 2).mean()
        loss.backward()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        losses.append(float(tot) / world)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    m.close()
    if rank == 0:
        print(json.dumps({"world_size": world, "steps": a.steps, "first_loss": losses[0], "last_loss": losses[-1],
                          "shardings": {t.name: t.sharding.value for t in p.tables}}), flush=True)


def _local_entry(rank: int, world: int, a: argparse.Namespace) -> None:
    train(rank, world, a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--local", type=int, default=0, help="spawn this many local ranks instead of torchrun")
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--device-mb", type=float, default=64.0, help="device memory per rank for the planner")
    ap.add_argument("--plan", default=None, help="a saved ShardingPlan JSON (hiermem plan CONFIG --json)")
    ap.add_argument("--path", default=None, help="store base directory (default: a temporary one)")
    a = ap.parse_args()
    if a.path is None:
        a.path = tempfile.mkdtemp(prefix="hiermem-shard-")
    if a.local:
        launch_local(a.local, _local_entry, a)
        return
    if "RANK" not in os.environ:
        ap.error("run under torchrun, or pass --local N")
    dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE come from torchrun
    try:
        train(dist.get_rank(), dist.get_world_size(), a)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
