"""Workers for tests/test_sharding_exec.py: sharded training vs the unsharded model.

Each rank trains the sharded collection on its own samples and, in the same process,
the unsharded reference (one HierarchicalStore holding every table whole, which
tests/test_store_exact.py checks against a flat table) on the global batch of all
ranks; losses and final rows must agree.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

import hiermem as hm
from hiermem.sharding import ShardingType, TierPlacement, Topology, naive_plan, plan

TABLES = (
    hm.TableSpec("t0", 1000, 8),
    hm.TableSpec("t1", 300, 12),
    hm.TableSpec("big", None, 8),  # unbounded: hashed 63-bit ids
    hm.TableSpec("t3", 50, 16),
)
B = 6
PROBE_BIG = 40  # distinct ids of the unbounded table (drawn from a fixed pool)
SSD_CACHE = 40  # device and host rows per shard: >= a batch's distinct rows (4 ranks x 6 x 3)


def planner_tables():
    rows = {"t0": 1000, "t1": 300, "big": 4000, "t3": 50}
    pf = {"t0": 30.0, "t1": 1.5, "big": 3.0, "t3": 1.0}  # t0 dominates: spread, not table-wise
    return [hm.PlannerTable(t.name, rows[t.name], t.dim, pf[t.name]) for t in TABLES]


def topology(world: int, small: bool) -> Topology:
    # small: device memory too small for the big tables, so the planner caches them
    # (tiny device caches over host, or SSD), and training runs through LMDB
    # and slow memory, so that compute matters and the planner mixes shardings
    if small:
        return Topology(world, ranks_per_host=2, device_bytes=6_000, host_bytes=60_000, ssd_bytes=1e9,
                        call_overhead_s=1e-4, device_bw=2e7, host_bw=1e7)
    return Topology(world, ranks_per_host=2, device_bytes=1e9, host_bytes=1e9, ssd_bytes=1e9, call_overhead_s=1e-4)


def plans(world: int, opt) -> list[tuple[str, hm.ShardingPlan]]:
    tabs, out = planner_tables(), []
    for st in (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
               ShardingType.DATA_PARALLEL, ShardingType.TABLE_ROW_WISE):
        out.append((st.value, naive_plan(tabs, topology(world, False), B, st, opt)))
    out.append(("planner", plan(tabs, topology(world, True), B, opt)))
    return out


def batch(step: int, rank: int, world: int, weighted: bool) -> hm.SparseFeatures:
    g = torch.Generator().manual_seed(1000 * step + rank)
    pool = torch.randint(0, 2**62, (PROBE_BIG,), generator=torch.Generator().manual_seed(7))
    lens, vals = [], []
    for t in TABLES:
        ln = torch.randint(0, 4, (B,), generator=g)
        n = int(ln.sum())
        if t.num_rows is None:
            v = pool[torch.randint(0, PROBE_BIG, (n,), generator=g)]
        else:  # skewed: low ids are hot
            v = (torch.rand(n, generator=g) ** 3 * t.num_rows).long()
        lens.append(ln)
        vals.append(v)
    w = torch.rand(sum(v.numel() for v in vals), generator=g) + 0.5 if weighted else None
    return hm.SparseFeatures(tuple(t.name for t in TABLES), torch.cat(vals), torch.cat(lens), w)


def target(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(555 + 1000 * step + rank)
    return torch.randn(B, sum(t.dim for t in TABLES), generator=g)


def _global(step: int, world: int, weighted: bool):
    """Per table (ids, offsets, weights) of the global batch (rank 0's samples first)."""
    fs = [batch(step, r, world, weighted).to_dict() for r in range(world)]
    out = {}
    for t in TABLES:
        ids = torch.cat([f[t.name][0] for f in fs])
        lens = [torch.diff(f[t.name][1], append=torch.tensor([f[t.name][0].numel()])) for f in fs]
        lens = torch.cat(lens)
        w = torch.cat([f[t.name][2] for f in fs]) if weighted else None
        out[t.name] = (ids, torch.cumsum(lens, 0) - lens, w)
    return out


def run_one(rank: int, world: int, name: str, p: hm.ShardingPlan, opt, base: Path, mode: str, weighted: bool,
            steps: int, chunk: int = 4096) -> dict:
    cfg = hm.StoreConfig(path=base / f"{name}-{opt.name}-{mode}", optimizer=opt, seed=3)
    m = hm.ShardedEmbeddingBagCollection(TABLES, p, cfg, mode=mode)
    ref = hm.HierarchicalStore(TABLES, hm.StoreConfig(path=base / f"ref-{name}-{opt.name}-{mode}-r{rank}",
                                                      optimizer=opt, seed=3, device_rows=20_000, host_rows=1000))
    lo = rank * B
    worst = 0.0
    touched = {t.name: [] for t in TABLES}
    for step in range(steps):
        f = batch(step, rank, world, weighted)
        y = target(step, rank)
        out = m(f)
        loss = 0.5 * ((out - y) ** 2).sum()
        loss.backward()
        tot = loss.detach().clone()
        dist.all_reduce(tot)
        # the unsharded model on the global batch
        gb = _global(step, world, weighted)
        ys = torch.cat([target(step, r) for r in range(world)])
        pooled = [ref.lookup_pooled(t.name, gb[t.name][0], gb[t.name][1], mode, gb[t.name][2]) for t in TABLES]
        full = torch.cat(pooled, 1)
        rloss = 0.5 * ((full - ys) ** 2).sum()
        torch.testing.assert_close(out.detach(), full[lo:lo + B], rtol=1e-5, atol=1e-5,
                                   msg=lambda s: f"{name} step {step}: outputs differ: {s}")
        assert torch.allclose(tot, rloss, rtol=1e-5, atol=1e-5), f"{name} step {step}: loss {tot} vs {rloss}"
        worst = max(worst, float((tot - rloss).abs() / rloss.abs().clamp(min=1e-12)))
        grad = full - ys
        for t, g in zip(TABLES, torch.split(grad, [t.dim for t in TABLES], 1)):
            ids, off, w = gb[t.name]
            ref.update_pooled(t.name, ids, off, g.contiguous(), mode, w)
            touched[t.name].append(ids)
    rows_max = 0.0
    for t in TABLES:  # every touched row plus some never touched
        ids = torch.unique(torch.cat(touched[t.name]))
        if t.num_rows is not None:
            ids = torch.unique(torch.cat((ids, torch.arange(0, t.num_rows, 7))))
        mine = ids[rank::world]  # each rank asks for some rows (a collective)
        got = m.rows(t.name, mine, chunk=chunk)
        want = ref.lookup(t.name, mine)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda s: f"{name} {t.name} rows: {s}")
        rows_max = max(rows_max, float((got - want).abs().max()) if got.numel() else 0.0)
    st = m.stats()
    m.close()
    ref.close()
    return {"plan": name, "opt": opt.name, "mode": mode, "steps": steps, "loss_rel_err": worst,
            "rows_max_abs_err": rows_max, "disk_reads": sum(v["disk"]["hits"] for k, v in st.items()
                                                            if k != "_store")}


def worker(rank: int, world: int, base: str, steps: int) -> None:
    base = Path(base)
    results = []
    for opt in (hm.SGD(lr=0.05), hm.RowWiseAdagrad(lr=0.1)):
        for name, p in plans(world, opt):
            results.append(run_one(rank, world, name, p, opt, base, "sum", False, steps))
        # the planner's plan with every shard on SSD behind tiny caches: rows go through LMDB
        ssd = dict(plans(world, opt))["planner"]
        ssd = replace(ssd, tables=tuple(replace(t, shards=tuple(
            replace(s, tier=TierPlacement.SSD, device_rows=SSD_CACHE, host_rows=SSD_CACHE) for s in t.shards))
            for t in ssd.tables))
        results.append(run_one(rank, world, "planner-ssd", ssd, opt, base, "sum", False, steps, chunk=8))
    # pooling variants on the planner's plan
    opt = hm.RowWiseAdagrad(lr=0.1)
    p = dict(plans(world, opt))["planner"]
    results.append(run_one(rank, world, "planner", p, opt, base, "mean", False, steps))
    results.append(run_one(rank, world, "planner-w", p, opt, base, "sum", True, steps))
    plan_info = {n: {t.name: (t.sharding.value, [s.rank for s in t.shards], [s.tier.value for s in t.shards])
                     for t in p.tables} for n, p in plans(world, opt)}
    (base / f"result-{rank}.json").write_text(json.dumps({"results": results, "plans": plan_info}))


def bad_input_worker(rank: int, world: int, base: str) -> None:
    """Bad input is refused with typed errors on every rank, and changes nothing; then the
    benchmark machinery (calibrate + time 3 plans) runs end to end."""
    import pytest

    from hiermem.sharding.calibrate import BENCH_WORKLOAD, Workload, bench_worker

    base = Path(base)
    opt = hm.RowWiseAdagrad(lr=0.1)
    p = dict(plans(world, opt))["planner"]
    cfg = hm.StoreConfig(path=base / "bad", optimizer=opt, seed=3)
    with pytest.raises(hm.InvalidTypeError):
        hm.ShardedEmbeddingBagCollection(TABLES, "not a plan", cfg)
    with pytest.raises(hm.InvalidArgumentError):
        hm.ShardedEmbeddingBagCollection(TABLES[:2], p, cfg)  # plan names other tables
    with pytest.raises(hm.InvalidArgumentError):
        hm.ShardedEmbeddingBagCollection(TABLES, p, cfg, mode="max")
    wrong = replace(p, world_size=world + 1)
    with pytest.raises(hm.InvalidArgumentError):
        hm.ShardedEmbeddingBagCollection(TABLES, wrong, cfg)
    m = hm.ShardedEmbeddingBagCollection(TABLES, p, cfg)
    probe = torch.arange(0, 50)
    before = m.rows("t3", probe)
    f = batch(0, rank, world, False)
    # one rank's features lack keys: every rank raises (the others learn it from the header)
    good = batch(5, rank, world, False)
    with pytest.raises(hm.InvalidArgumentError):
        m(hm.SparseFeatures(("t0",), torch.tensor([1]), torch.tensor([1])) if rank == 1 else good)
    # one rank's gradient holds NaN: every rank raises in backward, no shard changes
    out = m(good)
    g = torch.ones_like(out)
    if rank == 0:
        g[0, 0] = float("nan")
    with pytest.raises(hm.NonFiniteGradientError):
        out.backward(g)
    assert torch.equal(before, m.rows("t3", probe))
    # rank 0 sends an id outside t3's rows: every rank raises, nothing is looked up or updated
    if rank == 0:
        bad_vals = f.values.clone()
        lengths = f.lengths.clone()
        lengths[-1] += 1  # one more id in t3's last bag (t3 is the last key; 50 rows)
        bad_vals = torch.cat((f.values, torch.tensor([10_000])))
        f = hm.SparseFeatures(f.keys, bad_vals, lengths)
    with pytest.raises(hm.InvalidIdError):
        m(f)
    after = m.rows("t3", probe)
    assert torch.equal(before, after)
    out = m(batch(1, rank, world, False))  # still works afterwards
    out.sum().backward()
    m.close()
    tiny = Workload(BENCH_WORKLOAD.tables[:3], batch_size=16)
    bench_worker(rank, world, str(base / "bench"), ("planner", "TW", "RW"), 1, 1, tiny)
