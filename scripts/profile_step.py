"""Where one bench_train configuration's step time goes: cProfile (and, on CUDA, the torch
profiler) over steady-state steps of the same model, batches and cache sizing as
``scripts/bench_train.py --quick``.

    python scripts/profile_step.py                                   # zipf1.05, all-device
    python scripts/profile_step.py --workload criteo --kind disk_pf --size 2
    python scripts/profile_step.py --device cuda --kind host_pf --torch-profile

``--kind``: ``device`` (every row on the device tier), ``host_pf`` (every row in host,
prefetch depth 2), ``disk`` / ``disk_pf`` (device ``size`` x W, host 8x that, the rest on
LMDB; without / with prefetch).  Warm-up is a fixed number of steps (``--warmup``), then
``--steps`` steps are profiled; the baseline (plain ``nn.EmbeddingBag``) is timed over
the same batches for the ratio.  Prints the top functions by own time and by cumulative
time; with ``--torch-profile`` also the torch profiler's operator table (host and
device time).  A diagnostic, not a benchmark: profiling slows Python code unevenly.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train as bt  # noqa: E402  (the same workloads, model and store set-up)

import torch  # noqa: E402

import hiermem as hm  # noqa: E402
from hiermem.nn.dlrm import PlainEmbeddingBags  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="zipf1.05", choices=("zipf1.05", "zipf1.2", "criteo"))
    ap.add_argument("--kind", default="device", choices=("device", "host_pf", "disk", "disk_pf"))
    ap.add_argument("--size", type=int, default=2, help="device tier in multiples of W (disk kinds)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--torch-profile", action="store_true")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA")
        return 0
    dim, batch = 16, 256
    wl = (bt.criteo_workload(400_000, dim) if a.workload == "criteo" else
          bt.zipf_workload(float(a.workload[4:]), 120_000, dim, 4))
    batches = bt.make_batches(wl, a.warmup + 3 * a.steps + 40, batch)  # warm-up, timed, cProfile, torch profiler
    W = bt.working_set(wl, batches)
    total = sum(t.num_rows for t in wl.tables)
    if a.kind == "device":
        dev, host, depth, pre = total + 1024, 1024, 0, True
    elif a.kind == "host_pf":
        dev, host, depth, pre = int(a.size * W), total + 1024, bt.DEPTH, True
    else:
        dev = int(a.size * W)
        host, depth, pre = 8 * dev, (bt.DEPTH if a.kind == "disk_pf" else 0), False
    tmp = Path(tempfile.mkdtemp(prefix="hiermem-profile-"))
    try:
        plain = PlainEmbeddingBags(wl.tables)
        ck = bt.template(wl, plain, tmp)
        base = bt.Trainer(plain, len(wl.tables), dim, torch.optim.SGD(plain.parameters(), lr=0.05),
                          device=a.device, move_sparse=True)
        store = bt.open_store(ck, tmp / "s", wl, dev, host, False, pre, a.device)
        tr = bt.Trainer(hm.CachedEmbeddingBagCollection(wl.tables, store=store), len(wl.tables), dim, device=a.device)
        pipe = hm.PrefetchPipeline(iter(batches), tr.model.embeddings, depth=depth) if depth else None
        it = pipe if pipe is not None else iter(batches)
        for _ in range(a.warmup):
            tr.step(next(it))
        bt.settle(store, pipe)
        s0 = bt.snapshot(store, pipe)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            tr.step(next(it))
        bt.settle(store, pipe)
        t_ours = time.perf_counter() - t0
        f = bt.figures(s0, bt.snapshot(store, pipe), a.steps, batch, False, t_ours, 0.0)
        t0 = time.perf_counter()
        for b in batches[a.warmup + a.steps:a.warmup + 2 * a.steps]:
            base.step(b)
        bt.sync()
        t_base = time.perf_counter() - t0
        print(f"{wl.name}/{a.kind} on {a.device}: W = {W:.0f}, device rows {dev}, host rows {host}, "
              f"prefetch depth {depth} ({pipe.mode if pipe else 'none'}); unprofiled {1e3 * t_ours / a.steps:.2f} "
              f"ms/step vs baseline {1e3 * t_base / a.steps:.2f} ms/step: x{t_base / t_ours:.3f}")
        print("hit rates", f["hit_rates"], "; rows per step", f["rows_per_step"])
        if pipe is not None:
            print(f"pipeline: {pipe.mode}, {pipe.background_reason}; trials {pipe.stats()['trials']}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            tr.step(next(it))
        bt.settle(store, pipe)
        prof.disable()
        st = pstats.Stats(prof)
        for key in ("tottime", "cumtime"):
            print(f"\n-- cProfile, {a.steps} steps, by {key}")
            st.sort_stats(key).print_stats(a.top)
        if a.torch_profile:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if a.device == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as tp:
                for _ in range(min(a.steps, 20)):
                    tr.step(next(it))
                bt.settle(store, pipe)
            key = "self_cuda_time_total" if a.device == "cuda" else "self_cpu_time_total"
            print(f"\n-- torch profiler, {min(a.steps, 20)} steps, by {key}")
            print(tp.key_averages().table(sort_by=key, row_limit=a.top))
            print("\n-- torch profiler, by self_cpu_time_total")
            print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
        if pipe is not None:
            pipe.close()
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
