"""Benchmark hiermem's lookup + fused-update step against in-memory and naive baselines.

Every variant runs the same training step on the same pre-generated id batches
(B=4096 samples x 20 ids, 64-d fp32 rows): pool each sample's 20 rows by sum, take
the loss ``sum(pooled**2) / (2B)`` (so d loss / d pooled = pooled / B), and apply
plain SGD to the touched rows.  Throughput is ids/s (B*20 ids per step), wall time
by ``time.perf_counter`` over steps after a shared warm-up, measured in rounds with
the variants interleaved (rotated order), and reported as the median over rounds.

Variants:
  (a) ``nn.EmbeddingBag(sparse=True, mode="sum")`` + ``torch.optim.SGD``, in memory.
  (b) hiermem with every row in the device tier (device="cpu"):
      ``lookup_pooled`` -> hand-written gradient -> ``update_pooled`` with ``hm.SGD``.
  (c) hiermem with device 1% + host 10% of the rows, LMDB for the rest (temp dir).
  (d) naive cache: ``cachetools.LRUCache`` (11% of rows) of per-row numpy arrays over
      per-key LMDB get/put, write-back on eviction (few steps: it is slow).
  (e) FBGEMM ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU, EXACT_SGD fused into
      backward (None when ``fbgemm_gpu`` does not import, or with ``--no-fbgemm``).

Workloads: Zipf(alpha=1.05) ids over a 4M-row table, and the Criteo DAC head's global
(field, value) stream (``hiermem.nn.data.criteo_global_stream``, cycled in batches over a
table of its cardinality).  A Criteo batch touches ~60% of that table, more than 11%
of its rows, so for it (c)/(d) get a cache of 1.1x the largest batch's distinct rows.

(b) has room for every row and is pre-warmed by looking up, in chunks, every id that
any batch of the run touches, so its timed steps are all device hits.  That is faster
than initialising all 4M rows and keeps the initialiser's
misses out of the timed steps, as a lazy fill would not.  Those rows also initialise
(a) and (e) (other rows are never touched), and (a) vs (b) (and (e)) are checked for
equal rows after the warm-up steps.  The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import time

import cachetools
import lmdb
import numpy as np
import torch

import hiermem as hm
from hiermem.nn.data import ZipfIds, criteo_global_stream

B, L, DIM, LR = 4096, 20, 64, 0.05
PREWARM_CHUNK = 1 << 18


def pooled_grad(pooled: torch.Tensor) -> torch.Tensor:
    """d loss / d pooled for ``loss = sum(pooled**2) / (2B)``."""
    return pooled / pooled.shape[0]


class TorchBag:
    """(a) ``nn.EmbeddingBag`` + ``torch.optim.SGD`` on a sparse gradient."""

    def __init__(self, w0: torch.Tensor):
        self.emb = torch.nn.EmbeddingBag.from_pretrained(w0, freeze=False, mode="sum", sparse=True)
        self.opt = torch.optim.SGD(self.emb.parameters(), lr=LR)

    def step(self, ids: torch.Tensor) -> None:
        out = self.emb(ids.view(-1, L))
        (out.pow(2).sum() / (2 * out.shape[0])).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb.weight.detach()[ids]

    def close(self) -> None:
        pass


class Hier:
    """(b)/(c) a hiermem store; the step is the same math as (a), by hand."""

    def __init__(self, num_rows: int, device_rows: int, host_rows: int, tmp: str):
        cfg = hm.StoreConfig(path=f"{tmp}/store-{device_rows}", device="cpu", device_rows=device_rows,
                             host_rows=host_rows, optimizer=hm.SGD(lr=LR), map_size=1 << 32)
        self.store = hm.HierarchicalStore([hm.TableSpec("t", num_rows, DIM)], cfg)
        self.offsets: dict[int, torch.Tensor] = {}

    def prewarm(self, num_rows: int, touched: torch.Tensor) -> torch.Tensor:
        """Look up the ``touched`` rows once (in chunks); returns weights [num_rows, DIM]
        holding their initial values (zero elsewhere)."""
        w = torch.zeros((num_rows, DIM))
        for ids in touched.split(PREWARM_CHUNK):
            w[ids] = self.store.lookup("t", ids)
        return w

    def step(self, ids: torch.Tensor) -> None:
        offsets = self.offsets.get(ids.numel())
        if offsets is None:
            offsets = self.offsets[ids.numel()] = torch.arange(0, ids.numel(), L)
        pooled = self.store.lookup_pooled("t", ids, offsets)  # fused gather + sum pooling
        self.store.update_pooled("t", ids, offsets, pooled_grad(pooled))  # same ids object: reuses placement

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.store.lookup("t", ids)

    def tier_counts(self) -> dict:
        s = self.store.stats()["t"]
        return {t: (s[t]["hits"], s[t]["lookups"]) for t in ("device", "host", "disk")}

    def close(self) -> None:
        self.store.close()


class _WriteBackLRU(cachetools.LRUCache):
    def __init__(self, maxsize: int, owner: "NaiveCache"):
        super().__init__(maxsize)
        self.owner = owner

    def popitem(self):
        k, v = super().popitem()
        if k in self.owner.dirty:
            self.owner.dirty.discard(k)
            self.owner.txn.put(k.to_bytes(8, "big"), v.tobytes())
        return k, v


class NaiveCache:
    """(d) per-row numpy arrays in a ``cachetools.LRUCache`` over per-key LMDB get/put."""

    def __init__(self, capacity: int, tmp: str):
        self.env = lmdb.open(f"{tmp}/naive", map_size=1 << 32, readahead=False, meminit=False)
        self.cache = _WriteBackLRU(capacity, self)
        self.dirty: set[int] = set()
        self.rng = np.random.default_rng(0)
        self.bound = 1.0 / math.sqrt(DIM)
        self.txn = None

    def _row(self, k: int) -> np.ndarray:
        r = self.cache.get(k)
        if r is None:
            raw = self.txn.get(k.to_bytes(8, "big"))
            if raw is None:
                r = self.rng.uniform(-self.bound, self.bound, DIM).astype(np.float32)
            else:
                r = np.frombuffer(raw, dtype=np.float32).copy()
            self.cache[k] = r
        return r

    def step(self, ids: torch.Tensor) -> None:
        keys = ids.tolist()
        with self.env.begin(write=True) as txn:
            self.txn = txn
            rows = np.stack([self._row(k) for k in keys])
            g = rows.reshape(-1, L, DIM).sum(1) / (len(keys) // L) * LR
            for i, k in enumerate(keys):
                r = self._row(k)
                r -= g[i // L]
                self.dirty.add(k)
        self.txn = None

    def close(self) -> None:
        self.env.close()


class Fbgemm:
    """(e) FBGEMM's table-batched embedding bag on CPU, SGD fused into backward."""

    def __init__(self, w0: torch.Tensor):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (ComputeDevice, EmbeddingLocation,
                                                                          PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        self.m = SplitTableBatchedEmbeddingBagsCodegen(
            [(w0.shape[0], DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_SGD,
            learning_rate=LR, pooling_mode=PoolingMode.SUM)
        with torch.no_grad():
            self.m.split_embedding_weights()[0].copy_(w0)
        self.offsets = torch.arange(0, B * L + 1, L)

    def step(self, ids: torch.Tensor) -> None:
        out = self.m(ids, self.offsets)
        (out.pow(2).sum() / (2 * out.shape[0])).backward()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m.split_embedding_weights()[0].detach()[ids]

    def close(self) -> None:
        pass


def fbgemm_available() -> bool:
    try:
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except Exception as e:  # ImportError, or a failing native library load
        print(f"fbgemm_gpu unavailable: {type(e).__name__}: {e}")
        return False
    return True


def run_workload(name: str, batches: list[torch.Tensor], num_rows: int, cache_rows: int, args) -> dict:
    """Build all variants over ``num_rows`` rows, warm up, time interleaved rounds; return results."""
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    n_ids = B * L
    dev_rows = max(1, num_rows // 100)
    print(f"\n== {name}: {num_rows:,} rows x {DIM}, {len(batches)} batches of {n_ids:,} ids, "
          f"(c)/(d) cache {cache_rows:,} rows (device {dev_rows:,})")
    tmp = tempfile.TemporaryDirectory(prefix="bench-store-")
    v: dict = {}
    try:
        t0 = time.perf_counter()
        v["b"] = Hier(num_rows, num_rows, 1024, tmp.name)
        every = torch.unique(torch.cat(batches))
        w0 = v["b"].prewarm(num_rows, every)
        print(f"(b) prewarmed the {every.numel():,} rows the run touches in {time.perf_counter() - t0:.1f} s")
        if args.fbgemm:
            v["e"] = Fbgemm(w0)
        v["a"] = TorchBag(w0)  # takes w0 as its weight
        v["c"] = Hier(num_rows, dev_rows, cache_rows - dev_rows, tmp.name)
        v["d"] = NaiveCache(cache_rows, tmp.name)
        del w0
        for key in sorted(v):
            t0 = time.perf_counter()
            for ids in warm:
                v[key].step(ids)
            print(f"({key}) warm-up {len(warm)} steps: {time.perf_counter() - t0:.1f} s")
        touched = torch.unique(torch.cat(warm))
        ref = v["a"].rows(touched)
        exact = bool(torch.allclose(v["b"].rows(touched), ref, rtol=1e-5, atol=1e-5))
        exact_e = bool(torch.allclose(v["e"].rows(touched), ref, rtol=1e-5, atol=1e-5)) if "e" in v else None
        print(f"exact: {exact}  (b vs a on {touched.numel():,} rows after {len(warm)} steps; "
              f"fbgemm vs a: {exact_e})")
        b_before, c_before = v["b"].tier_counts(), v["c"].tier_counts()
        rates: dict = {k: [] for k in v}
        order = list(v)
        for r in range(args.rounds):
            chunk = timed[r * args.per_round:(r + 1) * args.per_round]
            rot = order[r % len(order):] + order[:r % len(order)]
            for key in rot:
                steps = chunk[:args.naive_steps] if key == "d" else chunk
                t0 = time.perf_counter()
                for ids in steps:
                    v[key].step(ids)
                rates[key].append(len(steps) * n_ids / (time.perf_counter() - t0))
        b_after, c_after = v["b"].tier_counts(), v["c"].tier_counts()
    finally:
        for obj in v.values():
            obj.close()
        v.clear()
        gc.collect()
        tmp.cleanup()
    ips = {k: statistics.median(x) for k, x in rates.items()}
    hit = {tier: tuple(c_after[tier][i] - c_before[tier][i] for i in (0, 1)) for tier in c_after}
    b_dev = tuple(b_after["device"][i] - b_before["device"][i] for i in (0, 1))
    return {"ips": ips, "hit": hit, "b_dev": b_dev, "exact": exact, "exact_fbgemm": exact_e}


def report(name: str, res: dict, prefix: str) -> dict:
    """Print the table and hit rates; return the JSON fields (keys prefixed)."""
    ips, labels = res["ips"], {"a": "torch EmbeddingBag+SGD", "b": "hiermem all-device",
                               "c": "hiermem 1%+10%+LMDB", "d": "naive LRUCache+LMDB",
                               "e": "FBGEMM TBE CPU"}
    print(f"\n{name}: {'variant':<28} {'ids/s':>12} {'vs (a)':>8}")
    for k in "abcde":
        val = ips.get(k)
        shown = f"{val:>12,.0f} {val / ips['a']:>8.3f}" if val else f"{'None':>12} {'-':>8}"
        print(f"{' ' * len(name)}  ({k}) {labels[k]:<24} {shown}")
    print("(c) hit rates over the timed steps:")
    out = {}
    for tier, (h, n) in res["hit"].items():
        rate = h / n if n else None
        out[f"c_{tier}_hit_rate"] = None if rate is None else round(rate, 4)
        print(f"    {tier:<7} {h:>10,} / {n:>10,} = " + ("n/a" if rate is None else f"{rate:.4f}"))
    out["b_device_hit_rate"] = round(res["b_dev"][0] / res["b_dev"][1], 4)
    print(f"(b) device hit rate over the timed steps: {out['b_device_hit_rate']:.4f}")
    e = ips.get("e")
    out.update(b_over_a=ips["b"] / ips["a"], b_over_fbgemm=ips["b"] / e if e else None,
               c_over_a=ips["c"] / ips["a"], c_over_d=ips["c"] / ips["d"], exact=res["exact"],
               exact_fbgemm=res["exact_fbgemm"])
    out.update({f"{k}_ids_per_s": (round(ips[k]) if ips.get(k) else None) for k in "abcde"})
    out = {k: round(x, 4) if isinstance(x, float) else x for k, x in out.items()}
    return {prefix + k: x for k, x in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few steps; finishes in under a minute")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 30, quick 6)")
    p.add_argument("--no-fbgemm", dest="fbgemm", action="store_false")
    p.add_argument("--no-criteo", dest="criteo", action="store_false")
    args = p.parse_args()
    t_start = time.perf_counter()
    print(f"hiermem {hm.__version__} from {hm.__file__}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}")
    steps = args.steps or (6 if args.quick else 30)
    args.rounds = 3 if args.quick else 5
    args.rounds = min(args.rounds, steps)
    args.per_round = math.ceil(steps / args.rounds)
    args.warmup = 2 if args.quick else 16
    args.naive_steps = 1 if args.quick else 2
    args.fbgemm = args.fbgemm and fbgemm_available()
    n_batches = args.warmup + args.rounds * args.per_round
    torch.manual_seed(0)

    num_rows = 4_000_000
    zipf = ZipfIds(num_rows, 1.05, seed=0)
    batches = [torch.from_numpy(zipf(B * L)) for _ in range(n_batches)]
    results = report("zipf", run_workload("zipf 1.05", batches, num_rows, num_rows * 11 // 100, args), "")

    stream = criteo_global_stream() if args.criteo else None
    results["criteo_skipped"] = stream is None
    if stream is None:
        print("\ncriteo workload skipped: " + ("--no-criteo" if not args.criteo else
                                               "../shared/data/criteo-dac-head8k not found"))
    else:
        idx = np.arange(B * L)
        batches = [torch.from_numpy(stream[(i * B * L + idx) % len(stream)]) for i in range(n_batches)]
        crows = int(stream.max()) + 1
        need = max(torch.unique(x).numel() for x in batches)
        cache = max(crows * 11 // 100, math.ceil(1.1 * need))
        results.update(report("criteo", run_workload("criteo", batches, crows, cache, args), "criteo_"))
    print(f"\ntotal time {time.perf_counter() - t_start:.1f} s; load average {os.getloadavg()[0]:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
