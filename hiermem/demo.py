"""``hiermem demo``: lookup + fused update steps through all three tiers, on built-in defaults."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from .data import ZipfIds
from .optim import RowWiseAdagrad
from .store import HierarchicalStore
from .types import StoreConfig, TableSpec, default_device


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 60
    batch: int = 2048
    ids_per_sample: int = 20
    num_rows: int = 1_000_000
    dim: int = 32
    alpha: float = 1.05
    device_rows: int = 10_000  # 1% of the bounded table
    host_rows: int = 100_000  # 10%
    policy: str = "lru"
    device: str | None = None
    path: str | None = None
    seed: int = 0


def _bar(i: int, n: int, width: int = 30) -> str:
    done = int(width * i / n)
    return "[" + "#" * done + "." * (width - done) + f"] {i}/{n}"


def run_demo(cfg: DemoConfig, out=None) -> dict:
    """Train random gradients into two tables (one bounded, one unbounded) via the store."""
    out = sys.stdout if out is None else out  # resolved per call (sys.stdout may be swapped)
    tmp = None
    path = cfg.path
    if path is None:
        tmp = tempfile.mkdtemp(prefix="hiermem-demo-")
        path = f"{tmp}/store"
    device = cfg.device or default_device()
    tables = [TableSpec("user", cfg.num_rows, cfg.dim), TableSpec("item_hash", None, cfg.dim)]
    store = HierarchicalStore(tables, StoreConfig(path=path, device=device, device_rows=cfg.device_rows,
                                                  host_rows=cfg.host_rows, policy=cfg.policy,
                                                  optimizer=RowWiseAdagrad(lr=0.05), seed=cfg.seed))
    users = ZipfIds(cfg.num_rows, cfg.alpha, seed=cfg.seed)
    items = ZipfIds(cfg.num_rows * 100, cfg.alpha, seed=cfg.seed + 1)  # sparse 64-bit-ish ids
    half = cfg.batch * cfg.ids_per_sample // 2
    print(f"hiermem demo: {store}", file=out)
    t0 = time.perf_counter()
    n_ids = 0
    try:
        for step in range(1, cfg.steps + 1):
            for name, gen in (("user", users), ("item_hash", items)):
                ids = torch.from_numpy(gen(half)).to(device)
                rows = store.lookup(name, ids)
                store.update(name, ids, rows * 0.01)  # stand-in gradient: pull rows toward 0
                n_ids += ids.numel()
            if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps:
                print("\r" + _bar(step, cfg.steps), end="", file=out, flush=True)
        store.flush()
        secs = time.perf_counter() - t0
        stats = store.stats()
    finally:
        store.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(file=out)
    summary = {"ids": n_ids, "seconds": round(secs, 3), "ids_per_s": round(n_ids / secs)}
    print(f"{'table':<10} {'tier':<7} {'lookups':>10} {'hits':>10} {'hit rate':>9} {'evictions':>10}", file=out)
    for name in ("user", "item_hash"):
        for tier in ("device", "host", "disk"):
            s = stats[name][tier]
            rate = s["hits"] / s["lookups"] if s["lookups"] else float("nan")
            summary[f"{name}_{tier}_hit_rate"] = round(rate, 4)
            print(f"{name:<10} {tier:<7} {s['lookups']:>10} {s['hits']:>10} {rate:>9.3f} {s['evictions']:>10}",
                  file=out)
    st = stats["_store"]
    print(f"moved: host->device {st['bytes_host_to_device'] / 2**20:.1f} MiB, device->host "
          f"{st['bytes_device_to_host'] / 2**20:.1f} MiB, disk->host {st['bytes_disk_to_host'] / 2**20:.1f} MiB, "
          f"host->disk {st['bytes_host_to_disk'] / 2**20:.1f} MiB", file=out)
    print(f"throughput: {summary['ids_per_s']:,} ids/s (lookup + fused row-wise Adagrad update) on {device}",
          file=out)
    print(json.dumps(summary), file=out)
    return summary
