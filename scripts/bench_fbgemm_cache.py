"""hiermem's host-backed pipelined step against FBGEMM's CUDA TBE with a managed cache
(``EmbeddingLocation.MANAGED_CACHING``: rows in UVM, a device cache in front), same cache
size, same batches, same SGD: speed, and results exact against each other.

Workload: bench_train's Zipf 1.05 tables (8 x ``--rows``, dim 16, batch ``--batch`` x 4);
W = mean distinct rows per batch; both caches hold 2 x W rows (FBGEMM's
``cache_load_factor`` = 2 W / all rows, LRU; hiermem's device tier 2 x W, every row in
its host tier, prefetch depth 1 on a background thread).  The step is the embedding side
of a training step (pooled lookup, a loss, backward with the optimizer fused), plus
``--dense-ms`` of GIL-free wait for the dense part (0: none).  Timed in alternating
blocks after a warm-up; the ratio is FBGEMM's time over hiermem's.  Exactness: both
train the same ``--exact-steps`` batches from the same weights; the pooled outputs of
every step and the final rows must agree to 1e-4.

Needs CUDA and the CUDA ``fbgemm-gpu`` wheel that pairs with the installed torch; without
them the last line is ``{"skipped": reason}`` and the exit status 0.

    python scripts/bench_fbgemm_cache.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hiermem as hm  # noqa: E402

LR = 0.05
BLOCK = 10


def skip(why: str) -> int:
    print(json.dumps({"skipped": why}))
    return 0


def fbgemm_managed(wl, plain, cache_rows: int, device: torch.device):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm, ComputeDevice,
                                                                      EmbeddingLocation, PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    total = sum(t.num_rows for t in wl.tables)
    m = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_rows, t.dim, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA) for t in wl.tables],
        optimizer=EmbOptimType.EXACT_SGD, learning_rate=LR, pooling_mode=PoolingMode.SUM,
        cache_load_factor=cache_rows / total, cache_algorithm=CacheAlgorithm.LRU, device=device)
    with torch.no_grad():
        for w, t in zip(m.split_embedding_weights(), wl.tables):
            w.copy_(plain.bags[t.name].weight.detach().to(w.device))
    return m


def fb_inputs(f: hm.SparseFeatures, device):
    off = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cumsum(f.lengths.to(torch.int64), 0)))
    return f.values.to(device, non_blocking=True), off.to(device, non_blocking=True)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum() / (2 * out.shape[0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="120k rows a table, 40 timed steps")
    ap.add_argument("--rows", type=int, default=None, help="rows per table (default 500k, quick 120k)")
    ap.add_argument("--batch", type=int, default=None, help="samples per batch (default 512, quick 256)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 200, quick 40)")
    ap.add_argument("--warmup", type=int, default=100, help="untimed steps first")
    ap.add_argument("--exact-steps", type=int, default=20, help="steps of the exactness run")
    ap.add_argument("--dense-ms", type=float, default=0.0, help="GIL-free wait per step for the dense part")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        return skip("needs CUDA")
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen  # noqa: F401
    except Exception as e:  # a CPU-only wheel, or one built for another torch
        return skip(f"fbgemm_gpu (CUDA) unavailable: {type(e).__name__}: {e}")
    from bench_train import make_batches, working_set, zipf_workload
    from hiermem.nn.dlrm import PlainEmbeddingBags

    a.rows = a.rows or (120_000 if a.quick else 500_000)
    a.batch = a.batch or (256 if a.quick else 512)
    a.steps = a.steps or (40 if a.quick else 200)
    dev = torch.device("cuda")
    wl = zipf_workload(1.05, a.rows, 16, 4)
    n = max(a.exact_steps, a.warmup + 2 * a.steps + 4)
    batches = make_batches(wl, n, a.batch)
    W = working_set(wl, batches)
    cache_rows = int(2 * W)
    total = sum(t.num_rows for t in wl.tables)
    torch.manual_seed(0)
    plain = PlainEmbeddingBags(wl.tables)
    wait_s = a.dense_ms * 1e-3

    def hiermem_coll(tmp: Path):
        cfg = hm.StoreConfig(path=tmp, device_rows=cache_rows, host_rows=total + 1024, device="cuda",
                             optimizer=hm.SGD(lr=LR))
        return hm.CachedEmbeddingBagCollection.from_embedding_bags(dict(plain.bags.items()), cfg)

    with tempfile.TemporaryDirectory(prefix="hiermem-fbgemm-cache-") as td:
        # exactness: the same batches from the same weights
        fb = fbgemm_managed(wl, plain, cache_rows, dev)
        coll = hiermem_coll(Path(td) / "exact")
        worst_out = 0.0
        with hm.PrefetchPipeline(iter(batches[:a.exact_steps]), coll, depth=1, background=True) as pipe:
            for (_, f, _) in pipe:
                out_h = coll(f)
                out_f = fb(*fb_inputs(f, dev))
                worst_out = max(worst_out, float((out_h - out_f).abs().max()))
                loss_of(out_h).backward()
                loss_of(out_f).backward()
        torch.cuda.synchronize()
        worst_row = 0.0
        for t, w in zip(wl.tables, fb.split_embedding_weights()):
            ids = torch.unique(torch.cat([f.to_dict()[t.name][0] for _, f, _ in batches[:a.exact_steps]]))
            worst_row = max(worst_row, float((coll.store.lookup(t.name, ids).cpu() - w.detach()[ids.to(w.device)].cpu()
                                              ).abs().max()))
        coll.store.close()
        del fb

        # speed: alternating blocks after a warm-up
        fb = fbgemm_managed(wl, plain, cache_rows, dev)
        coll = hiermem_coll(Path(td) / "speed")
        it = iter(hm.PrefetchPipeline(iter(batches), coll, depth=1, background=True))

        def h_step():
            _, f, _ = next(it)
            out = coll(f)
            if wait_s:
                time.sleep(wait_s)
            loss_of(out).backward()

        j = [0]

        def f_step():
            _, f, _ = batches[j[0]]
            j[0] += 1
            out = fb(*fb_inputs(f, dev))
            if wait_s:
                time.sleep(wait_s)
            loss_of(out).backward()
        for _ in range(a.warmup):
            h_step()
            f_step()
        torch.cuda.synchronize()
        th = tf = 0.0
        for _ in range(max(1, a.steps // BLOCK)):
            t0 = time.perf_counter()
            for _ in range(BLOCK):
                h_step()
            it.wait_idle()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for _ in range(BLOCK):
                f_step()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            th, tf = th + t1 - t0, tf + t2 - t1
        st = it.stats()
        it.close()
        coll.store.close()
    steps = max(1, a.steps // BLOCK) * BLOCK
    res = {"hiermem_over_fbgemm_managed_caching": round(tf / th, 4), "hiermem_step_ms": round(1e3 * th / steps, 3),
           "fbgemm_step_ms": round(1e3 * tf / steps, 3), "cache_rows": cache_rows, "W": round(W, 1),
           "total_rows": total, "dense_ms": a.dense_ms, "exact": worst_out < 1e-4 and worst_row < 1e-4,
           "max_abs_diff_pooled": worst_out, "max_abs_diff_rows": worst_row,
           "critical_path_ms": round(1e3 * st["critical_path_seconds"] / max(1, st["steps"]), 3),
           "device": torch.cuda.get_device_name(0)}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
