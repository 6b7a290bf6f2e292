"""DLRM training throughput through hiermem vs plain in-memory nn.EmbeddingBag, one run.

Configurations (all on the same pre-generated Zipf batches, measured in this run):
  baseline      plain nn.EmbeddingBag(sparse=True) tables + torch.optim.SGD, all in memory
  device        hiermem, every row in the device tier (loaded before timing)
  disk          hiermem, device 1% + host 10% + LMDB for the rest, no prefetch
  disk_pf       the same with prefetch depth 2
  disk_pf_cold  the same with the LMDB file's pages dropped from the page cache first
                (posix_fadvise DONTNEED), prefetch depth 2
  host_pf       device 1% + a host tier that holds every row (loaded before timing),
                prefetch depth 2
  disk_wb, disk_pf_wb
                disk and disk_pf with StoreConfig(write_behind=True): eviction write-backs
                committed to LMDB by a writer thread
  disk_plain    disk with StoreConfig(writemap=False): commits copy their pages out with
                pwrite instead of writing through LMDB's (preallocated) map

Every hiermem store starts from the same LMDB holding every row (a checkpoint restored
per configuration).  Prints samples/s per configuration; the last line is one JSON
object with the ratios, including prefetch_disk_over_baseline and prefetch_disk_over_host.

    python scripts/bench_train.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import hiermem as hm
from hiermem.data import ZipfIds
from hiermem.dlrm import DLRM, PlainEmbeddingBags
from hiermem.stats import Counters


def make_batches(n, tables, batch, pooling, alpha, seed=0):
    """``n`` batches of (dense, SparseFeatures, labels): ``pooling`` Zipf ids per bag."""
    rng = np.random.default_rng(seed)
    zipf = [ZipfIds(t.num_rows, alpha, seed=seed + i) for i, t in enumerate(tables)]
    out = []
    for _ in range(n):
        vals = np.concatenate([z(batch * pooling) for z in zipf])
        lengths = torch.full((len(tables) * batch,), pooling, dtype=torch.int64)
        f = hm.SparseFeatures(tuple(t.name for t in tables), torch.from_numpy(vals), lengths)
        out.append((torch.from_numpy(rng.standard_normal((batch, 13), dtype=np.float32)), f,
                    torch.from_numpy((rng.random(batch) < 0.25).astype(np.float32))))
    return out


def train(model, emb_opt, batches, pipe_depth=0, warmup=3):
    """Samples/s over ``batches`` after ``warmup`` steps (which are not timed)."""
    dense_opt = torch.optim.SGD(model.dense_parameters(), lr=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    emb = model.embeddings
    it = hm.PrefetchPipeline(iter(batches), emb, depth=pipe_depth) if pipe_depth else iter(batches)
    t0, n = None, 0
    for i, (dense, f, y) in enumerate(it):
        if i == warmup:
            t0 = time.perf_counter()
        loss = loss_fn(model(dense, f), y)
        dense_opt.zero_grad()
        if emb_opt is not None:
            emb_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if emb_opt is not None:
            emb_opt.step()
        if i >= warmup:
            n += y.numel()
    dt = time.perf_counter() - t0
    if pipe_depth:
        it.close()
    return n / dt


def drop_page_cache(path: Path) -> None:
    for f in path.glob("*.mdb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small tables and few steps (< 60 s)")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=None, help="rows per table (default 500k, quick 100k)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 30, quick 10)")
    ap.add_argument("--in-thread-io", action="store_true",
                    help="background LMDB I/O on the store's threads, not its I/O processes (io_process=False)")
    a = ap.parse_args(argv)
    rows = a.rows or (100_000 if a.quick else 500_000)
    steps = a.steps or (10 if a.quick else 30)
    warmup = 3
    torch.manual_seed(0)
    tables = [hm.TableSpec(f"t{i}", rows, a.dim) for i in range(a.tables)]
    total = rows * a.tables
    batches = make_batches(steps + warmup, tables, a.batch, a.pooling, a.alpha)
    distinct = np.mean([torch.unique(f.values + torch.repeat_interleave(
        torch.arange(a.tables) * rows, f.key_lengths())).numel() for _, f, _ in batches])
    print(f"bench_train: {a.tables} tables x {rows} rows x dim {a.dim} ({total * a.dim * 4 / 2**20:.0f} MiB), "
          f"batch {a.batch} x {a.pooling} ids per table, Zipf {a.alpha}; {distinct:.0f} distinct rows per batch; "
          f"{steps} timed steps", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="hiermem-bench-train-"))
    res = {}
    try:
        plain = PlainEmbeddingBags(tables)
        torch.manual_seed(1)
        model = DLRM(plain, a.tables, a.dim)
        res["baseline"] = train(model, torch.optim.SGD(plain.parameters(), lr=0.05), batches, warmup=warmup)
        # one LMDB template holding every row, restored for each hiermem configuration
        t0 = time.perf_counter()
        tmpl = hm.CachedEmbeddingBagCollection.from_embedding_bags(
            dict(plain.bags.items()), hm.StoreConfig(path=tmp / "template-live", device_rows=1024, host_rows=1024,
                                                     optimizer=hm.SGD(lr=0.05)))
        ck = tmpl.checkpoint(tmp / "template")
        tmpl.store.close()
        shutil.rmtree(tmp / "template-live")
        print(f"  LMDB template of {total} rows written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        dev1, host10 = max(1, total // 100), max(1, total // 10)
        # (device rows, host rows, prefetch depth, drop LMDB pages first, preload every row, write-behind,
        #  writemap: None is the default, on where the filesystem allows)
        configs = {"device": (total + 1024, 1024, 0, False, True, False, None),
                   "disk": (dev1, host10, 0, False, False, False, None),
                   "disk_pf": (dev1, host10, 2, False, False, False, None),
                   "disk_pf_cold": (dev1, host10, 2, True, False, False, None),
                   "host_pf": (dev1, total + 1024, 2, False, True, False, None),
                   "disk_wb": (dev1, host10, 0, False, False, True, None),
                   "disk_pf_wb": (dev1, host10, 2, False, False, True, None),
                   "disk_plain": (dev1, host10, 0, False, False, False, False)}
        writemap = {}
        for name, (d, h, depth, cold, preload, wb, wm) in configs.items():
            path = tmp / name
            store = hm.HierarchicalStore.restore(ck, path, device_rows=d, host_rows=h, write_behind=wb,
                                                 io_process=not a.in_thread_io, writemap=wm)
            writemap[name] = store.stats()["_store"]["disk_writemap"]
            if preload:  # every row resident before timing (device-resident / host-backed)
                for t in tables:
                    for i in range(0, rows, 1 << 16):
                        store.lookup(t.name, torch.arange(i, min(rows, i + (1 << 16))))
                store.counters = Counters(len(tables))
            if cold:
                drop_page_cache(path)
            emb = hm.CachedEmbeddingBagCollection(tables, store=store)
            torch.manual_seed(1)
            res[name] = train(DLRM(emb, a.tables, a.dim), None, batches, pipe_depth=depth, warmup=warmup)
            st = store.stats()
            hits = {t: sum(st[x.name][t]["hits"] for x in tables) / max(1, sum(st[x.name][t]["lookups"]
                                                                             for x in tables))
                    for t in ("device", "host", "disk")}
            res[name + "_hit_rates"] = {k: round(v, 4) for k, v in hits.items()}
            store.close()
            shutil.rmtree(path)
        for k in ("baseline", *configs):
            print(f"  {k:13s} {res[k]:12.0f} samples/s   x{res[k] / res['baseline']:.2f} of baseline", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    b = res["baseline"]
    out = {"baseline_samples_per_s": round(b, 1),
           **{f"{k}_samples_per_s": round(res[k], 1) for k in configs},
           "device_over_baseline": round(res["device"] / b, 3),
           "disk_over_baseline": round(res["disk"] / b, 3),
           "prefetch_disk_over_baseline": round(res["disk_pf"] / b, 3),
           "prefetch_cold_disk_over_baseline": round(res["disk_pf_cold"] / b, 3),
           "prefetch_disk_over_host": round(res["disk_pf"] / res["host_pf"], 3),
           "prefetch_over_no_prefetch": round(res["disk_pf"] / res["disk"], 3),
           "write_behind_disk_over_baseline": round(res["disk_wb"] / b, 3),
           "write_behind_prefetch_disk_over_baseline": round(res["disk_pf_wb"] / b, 3),
           "write_behind_over_sync": round(res["disk_wb"] / res["disk"], 3),
           "writemap_over_plain": round(res["disk"] / res["disk_plain"], 3),
           "hit_rates": {k: res[k + "_hit_rates"] for k in configs},
           "distinct_rows_per_batch": round(float(distinct), 1), "rows": total, "quick": a.quick,
           "io_process": not a.in_thread_io, "writemap": writemap}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
