"""Train a DLRM over sharded embeddings: under torchrun (one or many nodes), locally, or unsharded.

    # one host, 2 ranks (gloo on CPU, NCCL with --backend nccl on GPUs)
    torchrun --standalone --nproc-per-node 2 scripts/train_sharded.py --steps 20
    # two nodes x 8 ranks: run on every node with its --node-rank (see docs/sharding.md)
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d \
        --rdzv-endpoint node0.example:29500 --rdzv-id job1 scripts/train_sharded.py --ranks-per-host 8
    # or without torchrun: 2 local processes
    python scripts/train_sharded.py --local 2
    # the unsharded reference: one process, the global batch of N ranks
    python scripts/train_sharded.py --reference 4

Every rank plans the same tables with the same inputs (so every rank gets the same
plan; ``--plan plan.json`` loads a saved one instead), builds its shards' store under
``--path/rank<r>``, and trains ``hiermem.nn.dlrm.DLRM`` (dense MLPs replicated, their
gradients all-reduced; embeddings sharded, fused row-wise Adagrad) on synthetic skewed
batches of ``--batch`` samples per rank.  The loss of a step is the mean over the
global batch, so any world size (and ``--reference``) trains the same model.  Rank 0
prints the plan and the loss per step; ``--out DIR`` writes ``DIR/result.json``
(losses, rows of probe ids); the last line is JSON.
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
from hiermem.nn.dlrm import DLRM  # noqa: E402
from hiermem.sharding import PlannerTable, ShardingPlan, Topology, launch_local, plan  # noqa: E402
from hiermem.sharding.calibrate import Workload  # noqa: E402
from hiermem.sharding.config import format_plan  # noqa: E402

DIM, DENSE = 16, 13
TABLES = (PlannerTable("user", 20_000, DIM, 4.0, 0.7), PlannerTable("item", 50_000, DIM, 8.0, 0.7),
          PlannerTable("ctx", 2_000, DIM, 2.0, 0.5), PlannerTable("cat", 300, DIM, 1.0, 0.5),
          PlannerTable("geo", 5_000, DIM, 1.0, 0.6))
#: Probe rows compared at the end: the hot head of every table and a stride over the rest.
PROBE_HEAD, PROBE_STRIDE = 256, 97


def _work(batch: int) -> Workload:
    return Workload(TABLES, batch_size=batch, per_table_skew=True)


def _dense(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + 7919 * rank + 1)
    x = torch.randn(batch, DENSE, generator=g)
    return x, (torch.rand(batch, generator=g) < 0.25).float()


def _model(emb: torch.nn.Module) -> DLRM:
    torch.manual_seed(0)  # every rank (and the reference) starts with the same dense weights
    return DLRM(emb, len(TABLES), DIM, dense_in=DENSE, bottom=(32,), top=(32,))


def _probe(t: PlannerTable) -> torch.Tensor:
    return torch.unique(torch.cat((torch.arange(min(PROBE_HEAD, t.num_rows)), torch.arange(0, t.num_rows,
                                                                                            PROBE_STRIDE))))


def _optimizer():
    return hm.RowWiseAdagrad(lr=0.05)


def train(rank: int, world: int, a: argparse.Namespace) -> None:
    work = _work(a.batch)
    opt = _optimizer()
    rph = min(a.ranks_per_host, world)
    p = ShardingPlan.from_json(Path(a.plan).read_text()) if a.plan else \
        plan(work.tables, Topology(world, rph, device_bytes=a.device_mb * 1e6), work.batch_size, opt)
    dev = torch.device("cuda", torch.cuda.current_device()) if a.backend == "nccl" else torch.device("cpu")
    emb = hm.ShardedEmbeddingBagCollection(work.specs(), p, hm.StoreConfig(Path(a.path), device=str(dev),
                                                                           optimizer=opt, seed=1))
    model = _model(emb).to(dev)
    dense = model.dense_parameters()
    sgd = torch.optim.SGD(dense, lr=0.1)
    if rank == 0:
        print(format_plan(p), flush=True)
    losses = []
    for step in range(a.steps):
        x, y = (t.to(dev) for t in _dense(step, rank, a.batch))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, work.batch(step, rank)), y,
                                                                    reduction="sum") / (a.batch * world)
        sgd.zero_grad()
        loss.backward()  # embedding rows update here, on the ranks that own them
        for q in dense:  # the dense part is replicated: sum its gradients over ranks
            dist.all_reduce(q.grad)
        sgd.step()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        losses.append(float(tot))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    rows = {t.name: emb.rows(t.name, _probe(t)).tolist() for t in work.tables}  # a collective
    emb.close()
    if rank == 0:
        _report(a, world, losses, rows, {t.name: t.sharding.value for t in p.tables})


def reference(a: argparse.Namespace) -> None:
    """One process, unsharded: the same model on the global batch of ``a.reference`` ranks."""
    world, work = a.reference, _work(a.batch)
    specs = work.specs()
    rows_total = sum(t.num_rows for t in specs)
    emb = hm.CachedEmbeddingBagCollection(specs, hm.StoreConfig(Path(a.path) / "reference", optimizer=_optimizer(),
                                                                seed=1, device_rows=rows_total, host_rows=1024))
    model = _model(emb)
    sgd = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    losses = []
    for step in range(a.steps):
        fs = [work.batch(step, r).to_dict() for r in range(world)]
        ids, lens = [], []
        for t in specs:  # the global batch: rank 0's samples, then rank 1's, ...
            for f in fs:
                v, off, _ = f[t.name]
                ids.append(v)
                lens.append(torch.diff(off, append=torch.tensor([v.numel()])))
        feats = hm.SparseFeatures(tuple(t.name for t in specs), torch.cat(ids), torch.cat(lens))
        xs, ys = zip(*(_dense(step, r, a.batch) for r in range(world)))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(torch.cat(xs), feats), torch.cat(ys),
                                                                    reduction="sum") / (a.batch * world)
        sgd.zero_grad()
        loss.backward()
        sgd.step()
        losses.append(float(loss))
        print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    rows = {t.name: emb.store.lookup(t.name, _probe(t)).tolist() for t in work.tables}
    emb.store.close()
    _report(a, world, losses, rows, {t.name: "unsharded" for t in specs})


def _report(a, world: int, losses: list[float], rows: dict, shardings: dict) -> None:
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "result.json").write_text(json.dumps({"losses": losses, "rows": rows, "world_size": world}))
    print(json.dumps({"world_size": world, "steps": a.steps, "first_loss": losses[0], "last_loss": losses[-1],
                      "shardings": shardings}), flush=True)


def _local_entry(rank: int, world: int, a: argparse.Namespace) -> None:
    train(rank, world, a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--local", type=int, default=0, help="spawn this many local ranks instead of torchrun")
    ap.add_argument("--reference", type=int, default=0, help="train unsharded on the global batch of N ranks")
    ap.add_argument("--ranks-per-host", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    ap.add_argument("--device-mb", type=float, default=1.0, help="device memory per rank for the planner")
    ap.add_argument("--plan", default=None, help="a saved ShardingPlan JSON (hiermem plan CONFIG --json)")
    ap.add_argument("--path", default=None, help="store base directory (default: a temporary one)")
    ap.add_argument("--out", default=None, help="write losses and probe rows to OUT/result.json")
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    a = ap.parse_args()
    if a.path is None:
        a.path = tempfile.mkdtemp(prefix="hiermem-shard-")
    if a.reference:
        reference(a)
        return
    if a.local:
        launch_local(a.local, _local_entry, a, backend=a.backend)
        return
    if "RANK" not in os.environ:
        ap.error("run under torchrun, or pass --local N or --reference N")
    if a.backend == "nccl":  # one GPU per local rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(a.backend)  # MASTER_ADDR/PORT, RANK, WORLD_SIZE come from torchrun
    try:
        train(dist.get_rank(), dist.get_world_size(), a)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
