"""Sharded training over NCCL (CUDA tensors) equals the unsharded store: a GPU check.

    python scripts/nccl_check.py                      # world size 1, NCCL (gpu_check.sh)
    python scripts/nccl_check.py --world 2            # two GPUs
    python scripts/nccl_check.py --backend gloo --world 2   # the same check on CPU ranks

Every sharding type's uniform plan (TW, RW, CW, DP, TWRW) trains
``ShardedEmbeddingBagCollection`` (stores on each rank's GPU, collectives on NCCL) for a
few steps with row-wise Adagrad, against one unsharded ``HierarchicalStore`` on the
global batch: losses every step and every row at the end within 1e-5.  Without CUDA
(and ``--backend nccl``) it prints "no CUDA" and exits 0.  The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hiermem as hm  # noqa: E402
from hiermem.sharding import PlannerTable, ShardingType, Topology, launch_local, naive_plan  # noqa: E402
from hiermem.sharding.dist import all_reduce, comm_device  # noqa: E402
from hiermem.sharding.rules import SHARDING_RULES  # noqa: E402

TABLES = (hm.TableSpec("a", 1000, 8), hm.TableSpec("b", 300, 12), hm.TableSpec("c", 50, 16))
B = 8


def _batch(step: int, rank: int) -> hm.SparseFeatures:
    g = torch.Generator().manual_seed(1000 * step + rank)
    lens, vals = [], []
    for t in TABLES:
        ln = torch.randint(0, 4, (B,), generator=g)
        vals.append((torch.rand(int(ln.sum()), generator=g) ** 3 * t.num_rows).long())
        lens.append(ln)
    return hm.SparseFeatures(tuple(t.name for t in TABLES), torch.cat(vals), torch.cat(lens))


def _target(step: int, rank: int) -> torch.Tensor:
    return torch.randn(B, sum(t.dim for t in TABLES), generator=torch.Generator().manual_seed(7 + step + 97 * rank))


def _global(step: int, world: int) -> dict:
    fs = [_batch(step, r).to_dict() for r in range(world)]
    out = {}
    for t in TABLES:
        ids = torch.cat([f[t.name][0] for f in fs])
        lens = torch.cat([torch.diff(f[t.name][1], append=torch.tensor([f[t.name][0].numel()])) for f in fs])
        out[t.name] = (ids, torch.cumsum(lens, 0) - lens)
    return out


def _one(rank: int, world: int, name: str, p, dev: str, base: Path, steps: int) -> dict:
    opt = hm.RowWiseAdagrad(lr=0.1)
    m = hm.ShardedEmbeddingBagCollection(TABLES, p, hm.StoreConfig(base / name, device=dev, optimizer=opt, seed=3))
    ref = hm.HierarchicalStore(TABLES, hm.StoreConfig(base / f"ref-{name}-{rank}", device=dev, optimizer=opt, seed=3,
                                                      device_rows=2000, host_rows=64))
    worst = 0.0
    for step in range(steps):
        y = _target(step, rank).to(dev)
        out = m(_batch(step, rank))
        assert out.device == torch.device(dev), (out.device, dev)
        loss = 0.5 * ((out - y) ** 2).sum()
        loss.backward()
        tot = all_reduce(loss.detach().clone())
        gb = _global(step, world)
        ys = torch.cat([_target(step, r) for r in range(world)]).to(dev)
        full = torch.cat([ref.lookup_pooled(t.name, *gb[t.name]) for t in TABLES], 1)
        rloss = 0.5 * ((full - ys) ** 2).sum()
        worst = max(worst, float((tot - rloss).abs() / rloss.abs().clamp(min=1e-12)))
        for t, g in zip(TABLES, torch.split(full - ys, [t.dim for t in TABLES], 1)):
            ref.update_pooled(t.name, *gb[t.name], g.contiguous())
    rows = 0.0
    for t in TABLES:
        ids = torch.arange(t.num_rows)[rank::world]
        got, want = m.rows(t.name, ids), ref.lookup(t.name, ids).cpu()
        rows = max(rows, float((got - want).abs().max()))
    m.close()
    ref.close()
    return {"loss_rel_err": worst, "rows_max_abs_err": rows}


def worker(rank: int, world: int, base: str, steps: int) -> None:
    """One rank: every uniform plan vs the unsharded store; rank 0 writes ``base/result.json``."""
    cuda = dist.get_backend() == "nccl"
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    tabs = [PlannerTable(t.name, t.num_rows, t.dim, 1.5) for t in TABLES]
    topo = Topology(world, world)
    res = {}
    for st in ShardingType:
        if not all(SHARDING_RULES[st].shapes(t, topo, B, (st,)) for t in tabs):
            res[st.value] = None  # not applicable at this world size (column-wise needs >= 2 ranks)
            continue
        p = naive_plan(tabs, topo, B, st, hm.RowWiseAdagrad(lr=0.1))
        res[st.value] = _one(rank, world, st.value, p, dev, Path(base), steps)
    if rank == 0:
        Path(base, "result.json").write_text(json.dumps({"backend": dist.get_backend(), "device": dev,
                                                         "comm_device": str(comm_device()), "plans": res}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    a = ap.parse_args()
    if a.backend == "nccl" and not torch.cuda.is_available():
        print("no CUDA")
        return
    if a.backend == "nccl" and torch.cuda.device_count() < a.world:
        print(f"only {torch.cuda.device_count()} GPUs for world size {a.world}")
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="hiermem-nccl-") as d:
        launch_local(a.world, worker, d, a.steps, backend=a.backend)
        r = json.loads(Path(d, "result.json").read_text())
    worst = max(max(v["loss_rel_err"], v["rows_max_abs_err"]) for v in r["plans"].values() if v)
    for n, v in r["plans"].items():
        if v is None:
            print(f"{n:<5} not applicable at world size {a.world}")
            continue
        print(f"{n:<5} loss rel err {v['loss_rel_err']:.2e}  rows max abs err {v['rows_max_abs_err']:.2e}")
    ok = worst <= 1e-5
    print(json.dumps({"world_size": a.world, **{k: r[k] for k in ("backend", "device", "comm_device")},
                      "worst_err": worst, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
