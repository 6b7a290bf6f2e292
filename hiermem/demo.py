"""``hiermem demo``: train a small DLRM whose embedding tables do not fit the device tier.

Data: the real Criteo rows in ``../shared/data/criteo-dac-head8k`` when present (read in
place, cycled), any Criteo-layout TSV with ``--criteo PATH`` (streamed), or the seeded
synthetic :class:`~hiermem.data.CriteoLike` generator (``--synthetic``, or when the
shared data is absent).  The 26 categorical fields are hashed into tables each declared
``table_factor`` times larger than the device tier, six of them unbounded
(``num_rows=None``).  Embeddings train with row-wise Adagrad fused into the backward,
rows prefetched ``depth`` batches ahead; the dense MLPs with Adam.

A run directory holds the live store (``store/``) and checkpoints (``ckpt/step-N/`` with
the store snapshot ``emb/`` and ``dense.pt``; ``ckpt/LATEST`` names the last complete
one); ``--resume`` continues from it and sees exactly the batches it would have seen.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .data import CriteoLike, criteo_tsv_batches, shared_data_dir
from .dlrm import DLRM, criteo_features, criteo_tables
from .errors import HierMemError
from .modules import CachedEmbeddingBagCollection
from .optim import RowWiseAdagrad
from .pipeline import PrefetchPipeline
from .store import HierarchicalStore
from .types import StoreConfig, default_device

_MARK = "hiermem-demo.json"


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 300
    batch: int = 256
    dim: int = 16
    device_rows: int = 16384
    host_rows: int = 65536
    table_factor: int = 10  # every bounded table is declared 10x the device tier
    depth: int = 2  # prefetch depth (0: no prefetch)
    policy: str = "lru"
    lr: float = 0.05  # row-wise Adagrad on the embeddings
    dense_lr: float = 3e-3  # Adam on the MLPs
    checkpoint_every: int = 100
    device: str | None = None
    path: str = "runs/demo"
    seed: int = 0
    synthetic: bool = False
    criteo: str | None = None
    resume: bool = False
    progress: bool = True


def _source(cfg: DemoConfig) -> tuple[str, Path | None]:
    if cfg.criteo:
        p = Path(cfg.criteo)
        if not p.is_file():
            raise HierMemError(f"{p}: no such Criteo TSV file")
        return "criteo", p
    d = shared_data_dir()
    f = d / "criteo-dac-head8k" / "train.csv" if d else None
    if not cfg.synthetic and f is not None and f.is_file():
        return "criteo-dac-head8k", f
    return "synthetic", None


def batches(cfg: DemoConfig, tables, start: int):
    """``(dense, SparseFeatures, labels)`` batches from step ``start`` on."""
    kind, path = _source(cfg)
    if path is not None:
        it = criteo_tsv_batches(path, cfg.batch, start_batch=start)
    else:
        gen = CriteoLike(cfg.batch, seed=cfg.seed)
        it = (gen.batch_at(s) for s in range(start, 1 << 62))
    for labels, dense, cats in it:
        yield torch.from_numpy(dense), criteo_features(cats, tables, salt=cfg.seed), torch.from_numpy(labels)


def _bar(i: int, n: int, loss: float, width: int = 30) -> str:
    done = int(width * i / max(1, n))
    return f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} loss {loss:.4f}"


def _spark(xs: list[float]) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    lo, hi = min(xs), max(xs)
    return "".join(ticks[int((x - lo) / (hi - lo + 1e-12) * (len(ticks) - 1))] for x in xs)


def _save(run: Path, step: int, emb, model, opt, losses: list[float]) -> Path:
    ck = run / "ckpt"
    ck.mkdir(parents=True, exist_ok=True, mode=0o700)
    final, tmp = ck / f"step-{step:07d}", ck / f".step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    emb.checkpoint(tmp / "emb")
    dense = {k: v for k, v in model.named_parameters() if not k.startswith("embeddings.")}
    torch.save({"step": step, "dense": {k: v.detach().clone() for k, v in dense.items()},
                "opt": opt.state_dict(), "losses": torch.tensor(losses, dtype=torch.float64)}, tmp / "dense.pt")
    with open(tmp / "dense.pt", "rb+") as fh:
        os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest = ck / ".LATEST.tmp"
    latest.write_text(final.name + "\n")
    os.replace(latest, ck / "LATEST")
    return final


def _latest(run: Path) -> Path:
    f = run / "ckpt" / "LATEST"
    if not f.is_file():
        raise HierMemError(f"{run}: no checkpoint to resume from (run without --resume first)")
    return run / "ckpt" / f.read_text().strip()


def _prepare(cfg: DemoConfig, run: Path) -> None:
    """A fresh run directory (only ever deletes a directory a demo made)."""
    if run.exists() and any(run.iterdir()):
        if not (run / _MARK).is_file():
            raise HierMemError(f"{run}: exists and is not a hiermem demo run directory")
        shutil.rmtree(run)
    run.mkdir(parents=True, exist_ok=True, mode=0o700)
    (run / _MARK).write_text(json.dumps(asdict(cfg)))


def build(cfg: DemoConfig, run: Path, device: str):
    """The model, its embedding collection and the dense optimizer (resumed or fresh)."""
    tables = criteo_tables(cfg.table_factor * cfg.device_rows, cfg.dim)
    scfg = StoreConfig(path=run / "store", device=device, device_rows=cfg.device_rows, host_rows=cfg.host_rows,
                       policy=cfg.policy, optimizer=RowWiseAdagrad(lr=cfg.lr), seed=cfg.seed)
    start, losses, state = 0, [], None
    if cfg.resume:
        ck = _latest(run)
        store = HierarchicalStore.restore(ck / "emb", run / "store", device=device, device_rows=cfg.device_rows,
                                          host_rows=cfg.host_rows, policy=cfg.policy)
        emb = CachedEmbeddingBagCollection(tables, store=store)
        state = torch.load(ck / "dense.pt", weights_only=True)
        start, losses = int(state["step"]), state["losses"].tolist()
    else:
        _prepare(cfg, run)
        emb = CachedEmbeddingBagCollection(tables, scfg)
    torch.manual_seed(cfg.seed)
    model = DLRM(emb, len(tables), cfg.dim)
    opt = torch.optim.Adam(model.dense_parameters(), lr=cfg.dense_lr)
    if state is not None:
        with torch.no_grad():
            for k, p in model.named_parameters():
                if k in state["dense"]:
                    p.copy_(state["dense"][k])
        opt.load_state_dict(state["opt"])
    return tables, emb, model, opt, start, losses


def _summary(cfg: DemoConfig, emb, pipe, times: list[float], losses: list[float], start: int, kind: str) -> dict:
    st = emb.store.stats()
    agg = {t: {"lookups": 0, "hits": 0} for t in ("device", "host", "disk")}
    for name in emb.names:
        for t in agg:
            agg[t]["lookups"] += st[name][t]["lookups"]
            agg[t]["hits"] += st[name][t]["hits"]
    rates = {t: (a["hits"] / a["lookups"] if a["lookups"] else 0.0) for t, a in agg.items()}
    s = st["_store"]
    out = {"data": kind, "steps": len(times), "start_step": start, "batch": cfg.batch,
           **{f"{t}_hit_rate": round(r, 4) for t, r in rates.items()},
           "step_ms_median": round(1e3 * statistics.median(times), 3) if times else None,
           "samples_per_s": round(cfg.batch * len(times) / sum(times), 1) if times else None,
           "loss_first": losses[start] if len(losses) > start else None,
           "loss_last": losses[-1] if losses else None,
           "prefetch": pipe.stats() if pipe is not None else None,
           "disk_rows": s["disk_rows"], "device_rows": s["device_capacity"], "host_rows": s["host_capacity"]}
    return out


def run_demo(cfg: DemoConfig, out=None, err=None) -> dict:
    """Train the DLRM for ``cfg.steps`` steps (from the last checkpoint with ``resume``)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    run = Path(cfg.path)
    device = cfg.device or default_device()
    kind, _ = _source(cfg)
    tables, emb, model, opt, start, losses = build(cfg, run, device)
    model.to(device)
    print(f"hiermem demo: DLRM on {kind} data, {len(tables)} tables of dim {cfg.dim} "
          f"({sum(1 for t in tables if t.num_rows is None)} unbounded, the others "
          f"{cfg.table_factor}x the device tier), store {emb.store}", file=out)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    data = ((d.to(device), f, y.to(device)) for d, f, y in batches(cfg, tables, start))
    n = max(0, cfg.steps - start)
    pipe = PrefetchPipeline(_take(data, n), emb, depth=cfg.depth) if cfg.depth > 0 and n else None
    times: list[float] = []
    step = start
    try:
        for dense, feats, labels in (pipe if pipe is not None else _take(data, n)):
            t0 = time.perf_counter()
            loss = loss_fn(model(dense, feats), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            step += 1
            if cfg.progress and (step % 10 == 0 or step == cfg.steps):
                print(_bar(step - start, n, losses[-1]), end="", file=err, flush=True)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                _save(run, step, emb, model, opt, losses)
    finally:
        if pipe is not None:
            pipe.close()
    if cfg.progress and n:
        print(file=err)
    ck = _save(run, step, emb, model, opt, losses) if n else _latest(run)
    summary = _summary(cfg, emb, pipe, times, losses, start, kind)
    summary["checkpoint"] = str(ck)
    emb.store.close()
    _report(summary, losses, out)
    return summary


def _take(it, n: int):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def _report(s: dict, losses: list[float], out) -> None:
    print(f"hit rates: device {s['device_hit_rate']:.3f} | host (of device misses) {s['host_hit_rate']:.3f} | "
          f"disk (of host misses) {s['disk_hit_rate']:.3f}", file=out)
    p = s["prefetch"]
    if p:
        print(f"prefetch: depth {p['depth']}, {p['prefetched_batches']} batches, {p['prefetched_rows']} rows "
              f"brought up, {p['prefetch_hits']} ids served by prefetched rows, {p['late_batches']} late, "
              f"{p['prefetch_degraded']} degraded, effective depth min {p['min_effective_depth']} "
              f"mean {p['mean_effective_depth']:.2f}, waited {p['wait_seconds']:.2f} s", file=out)
    if s["steps"]:
        print(f"step time: median {s['step_ms_median']:.2f} ms, {s['samples_per_s']:.0f} samples/s", file=out)
    if losses:
        k = max(1, len(losses) // 30)
        curve = [float(np.mean(losses[i:i + k])) for i in range(0, len(losses), k)]
        print(f"loss: {curve[0]:.4f} {_spark(curve)} {curve[-1]:.4f}  ({len(losses)} steps, "
              f"{k} per mark)", file=out)
    print(f"checkpoint: {s['checkpoint']} (hiermem demo --resume continues)", file=out)
    print(json.dumps(s), file=out)
