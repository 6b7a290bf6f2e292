"""A GPU-shaped training step on this machine: does placement stay off the critical path?

The model is bench_train's embedding side (its workloads, batches and LMDB template)
with the dense part replaced by a GIL-free wait of ``--dense-ms`` (default 4 ms, the
H200's measured DLRM step; also run 2), standing for the accelerator's compute: the
training thread launches the pooled lookup, waits, runs the backward (hiermem: the fused
optimizer update; plain tables: sparse gradients and ``torch.optim.SGD``).  The wait is
``--wait spin`` (default: a compiled busy loop on the clock that holds no GIL, so the
training thread keeps one of the two cores, as a CUDA host thread spinning in a sync
does, and one core is left for hiermem's threads) or ``sleep`` (``time.sleep``: both
cores free).  torch runs one intra-op thread (``--threads``) so the cores are as said.

Baseline: plain ``nn.EmbeddingBag(sparse=True)`` per table + SGD with the same wait,
same batches, in alternating blocks of ``BLOCK`` steps (the machine's noise hits both);
a ratio is the baseline's time over hiermem's, summed over the blocks.  A hiermem block
ends by waiting for its background work (prefetch, read-ahead, write-behind), so none of
it runs in a baseline block and all of it is paid for.

Configurations (device tier in multiples of W, the mean distinct rows per batch):
``device``: every row on the device tier, no prefetch; ``host``: device 2 x W, every row
in the host tier, prefetch depth 2 on a background thread; ``disk``: Zipf 1.05, device
2 x W, host 8x that, the rest on LMDB, prefetch depth 2, write-behind on; ``criteo_disk``:
the Criteo-shaped workload sized alike.  Each is warmed up until its device hit rate
settles (and, disk-backed, the host tier evicts to LMDB), then timed.  With combined
write-backs (disk-backed) the timed window holds whole cycles of them (at least
``MIN_CYCLES``: the rows combined, handed to the writer and committed), and starts and
ends half a cycle after a hand-off (``--phase mid``, the default): a block ends by
waiting for the work in flight, and at a hand-off that is a whole cycle's commit (~25 ms
for ~17k rows, Zipf), which continuous training overlaps with the steps after it; with
blocks about a cycle long, ``--phase aligned`` makes every block end there (measured:
Zipf disk 0.64-0.70 aligned against the default's figure; see docs/performance.md).

Per configuration: the ratio, hit rates, rows per step across each boundary, and the
**critical path**: ms per step the training thread spends inside hiermem (taking the
batch from the pipeline, the module's forward with its wait for the prefetch, its
backward with the fused update; ``PrefetchPipeline.critical_path_seconds``), plus the
wait at block ends for background work; ``embedding_side_ms`` is the same thread's time
in the whole embedding side (taking the batch, the lookup, the loss and the whole
backward), against the baseline's (``baseline_embedding_ms``: lookup, loss, backward,
SGD step).  ``bg_ms``: the background
threads' store time per step; ``lmdb_ms``: LMDB read + write time per step (any thread);
``cpu_ms_per_step``: CPU time a timed step of each thread (``training``, ``prefetch``,
``read-ahead``, ``lmdb-writer``) and of the LMDB I/O children (``io_read``, ``io_write``),
from ``/proc`` (clock ticks: 10 ms over the window; the training thread's includes the
baseline blocks).

The fused update runs on the store's apply worker (``deferred_updates``, on here: torch
runs one thread, so a core is free; see docs/dataplane.md); ``--sync-updates`` runs it on
the training thread instead, and ``--ab-updates`` alternates timed blocks of both in one
run and reports each one's critical path (``critical_no_settle_by_updates_ms``).

    python scripts/bench_pipeline.py --quick            (< 120 s on an idle 2-core host)
    python scripts/bench_pipeline.py --quick --configs host --ab-updates --steps 120
    python scripts/bench_pipeline.py --dense-ms 2
    python scripts/bench_pipeline.py --quick --device cuda --real-dense   (on a GPU host)

The last line is one JSON object (``host_over_baseline``, ``disk_prefetch_over_baseline``,
``criteo_disk_prefetch_over_baseline``, ``device_over_baseline``,
``critical_path_share_host`` = critical-path ms / dense ms, and ``configs``).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import hiermem as hm  # noqa: E402
from bench_train import (criteo_workload, device_counts, figures, make_batches, open_store, snapshot,  # noqa: E402
                         template, working_set, zipf_workload)
from hiermem.nn.dlrm import DLRM, PlainEmbeddingBags  # noqa: E402
from hiermem.observe.stats import Stat  # noqa: E402
from hiermem.types import Tier  # noqa: E402

BLOCK = 10  # timed steps per block, alternating hiermem and the baseline
MIN_CYCLES = 2  # with combined write-backs, the window holds whole cycles: at least this many
CYCLE_CAP = 12  # ... within this many times --steps
WINDOW, TOLERANCE, MIN_WARMUP = 20, 0.005, 40
DEPTH = 1  # prefetch depth (--depth): a 2 x W device tier pins two batches (the one computing, the next)

_libc = ctypes.CDLL(None)
_clock_gettime = _libc.clock_gettime
_clock_gettime.argtypes = [ctypes.c_int, ctypes.c_void_p]
_clock_gettime.restype = ctypes.c_int
_MONOTONIC = 1


@numba.njit(nogil=True, cache=True)
def _spin(ns: int, buf: np.ndarray) -> int:
    """Busy-wait ``ns`` nanoseconds on CLOCK_MONOTONIC without the GIL."""
    _clock_gettime(_MONOTONIC, buf.ctypes.data)
    t0 = buf[0] * 1000000000 + buf[1]
    n = 0
    while True:
        _clock_gettime(_MONOTONIC, buf.ctypes.data)
        n += 1
        if buf[0] * 1000000000 + buf[1] - t0 >= ns:
            return n


class Wait:
    """The dense part: a GIL-free wait of ``ms`` (spin or sleep)."""

    def __init__(self, ms: float, kind: str):
        self.ns, self.kind, self._buf = int(ms * 1e6), kind, np.zeros(2, np.int64)
        _spin(1000, self._buf)  # compiled (or loaded) before any timing

    def __call__(self) -> None:
        if self.ns <= 0:
            return
        if self.kind == "spin":
            _spin(self.ns, self._buf)
        else:
            time.sleep(self.ns * 1e-9)


def gil_free(wait: Wait) -> float:
    """How much a Python thread gets done during the wait, relative to alone (about 1.0:
    the wait holds no GIL; about 0: it holds it)."""
    def count(seconds: float) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n
    import threading
    alone = count(0.05)
    got = []
    th = threading.Thread(target=lambda: got.append(count(0.05)))
    th.start()
    t_end = time.perf_counter() + 0.05
    while time.perf_counter() < t_end:
        wait()
    th.join()
    return got[0] / max(1, alone)


class Step:
    """One training step of an embedding module with the dense part a wait.

    ``real``: bench_train's DLRM (its dense MLPs run; ``--real-dense`` on a GPU host)."""

    def __init__(self, emb: nn.Module, n_tables: int, dim: int, wait: Wait, emb_opt=None,
                 device: str = "cpu", move_sparse: bool = False, real: bool = False):
        torch.manual_seed(1)
        self.emb, self.wait, self.real = emb, wait, real
        self.device = torch.device(device)
        self.move_sparse = move_sparse and device != "cpu"
        self.opts = [emb_opt] if emb_opt is not None else []
        if real:
            self.model = DLRM(emb, n_tables, dim).to(device)
            self.opts.append(torch.optim.SGD(self.model.dense_parameters(), lr=0.01))
        else:
            self.w = torch.randn(n_tables * dim, generator=torch.Generator().manual_seed(2)).to(device) * 0.1
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.inside = 0.0  # seconds of this thread in the embedding ops (and, for hiermem, taking batches)

    def __call__(self, it) -> None:
        t0 = time.perf_counter()
        dense, f, y = next(it)
        t1 = time.perf_counter()
        if self.device.type != "cpu":
            dense, y = dense.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            f = f.to(self.device) if self.move_sparse else f
        if self.real:
            logit = self.model(dense, f)  # the lookup is inside; timed as a whole below
            t2 = t1
        else:
            e = self.emb(f)
            t2 = time.perf_counter()
            logit = (e * self.w).sum(1)
            self.wait()
        loss = self.loss_fn(logit, y)
        t3 = time.perf_counter()
        for o in self.opts:
            o.zero_grad()
        loss.backward()
        for o in self.opts:
            o.step()
        t4 = time.perf_counter()
        self.inside += (t1 - t0) + (t2 - t1) + (t4 - t3)


_HZ = os.sysconf("SC_CLK_TCK")


def _cpu_of(stat_path: str) -> float:
    """CPU seconds (user + system) of the task whose ``/proc/.../stat`` is ``stat_path``."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's threads by name (hiermem's background threads
    and the training thread) and of its LMDB I/O children by mode (``io_read``,
    ``io_write``): where the background work's CPU goes (Linux; empty elsewhere)."""
    import threading
    out: dict[str, float] = {}
    try:
        names = {t.native_id: t.name for t in threading.enumerate()}
        me = os.getpid()
        kids = []
        for tid in os.listdir(f"/proc/{me}/task"):
            try:
                name = names.get(int(tid), "other")
                name = "training" if name == "MainThread" else name.replace("hiermem-", "")
                out[name] = out.get(name, 0.0) + _cpu_of(f"/proc/{me}/task/{tid}/stat")
                with open(f"/proc/{me}/task/{tid}/children") as f:
                    kids += f.read().split()
            except OSError:  # a thread that just ended
                pass
        for pid in kids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                at = [i for i, x in enumerate(argv) if b"lmdb_server" in x]  # the C build or _lmdb_server.py
                if not at or len(argv) <= at[0] + 3:
                    continue
                key = "io_write" if argv[at[0] + 3][:1] == b"w" else "io_read"  # PATH MAP_SIZE MODE ...
                out[key] = out.get(key, 0.0) + _cpu_of(f"/proc/{pid}/stat")
            except OSError:
                pass
    except OSError:
        return {}
    return out


def critical(coll, pipe) -> float:
    """Seconds the training thread has spent inside hiermem so far: the module's forwards
    and backwards, and taking batches from the pipeline."""
    if pipe is not None:
        return pipe.critical_path_seconds
    return coll.thread_seconds["forward"] + coll.thread_seconds["backward"]


def to_cycle(step: Step, it, comb, cap: int) -> int:
    """Untimed steps until combined write-backs are handed down (the combiner empties);
    the steps taken."""
    n = 0
    while n < cap:
        held = comb.n
        step(it)
        n += 1
        if comb.n < held:
            break
    return n


def settle(store, pipe) -> None:
    if pipe is not None:
        pipe.wait_idle()
    store.disk.drain()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm(step: Step, store, it, cap: int, fill_host: bool) -> tuple[int, bool]:
    """Untimed steps until the 20-step device hit rate settles (and, ``fill_host``, the
    host tier has evicted to LMDB)."""
    prev, base, n = None, device_counts(store), 0
    while n < cap:
        step(it)
        n += 1
        if n % WINDOW == 0:
            now = device_counts(store)
            h = 1 - (now[1] - base[1]) / max(1, now[0] - base[0])
            full = not fill_host or int(store.counters.table[:, Tier.HOST, Stat.EVICTIONS].sum()) > 0
            if prev is not None and abs(h - prev) < TOLERANCE and n >= MIN_WARMUP and full:
                return n, True
            prev, base = h, now
    return n, False


def run_config(ctx: dict, name: str, dev: int, host: int, depth: int, wb: bool, preload: bool) -> dict:
    a, wl, batches, base = ctx["args"], ctx["wl"], ctx["batches"], ctx["base"]
    t_start = time.perf_counter()
    prof = cProfile.Profile() if a.profile else None  # the training thread's timed steps only
    path = ctx["tmp"] / name.replace("/", "_")
    store = open_store(ctx["ck"], path, wl, dev, host, wb, preload, a.device)
    if a.sync_updates:
        store.deferred_updates = False
    os.sync()  # the restored files' dirty pages go down now, not in the timed window
    coll = hm.CachedEmbeddingBagCollection(wl.tables, store=store)
    step = Step(coll, len(wl.tables), a.dim, ctx["wait"], device=a.device, real=a.real_dense)
    pipe = (hm.PrefetchPipeline(iter(batches), coll, depth=depth, background=True,
                                 gil_slice=a.gil_slice if a.gil_slice > 0 else None) if depth else None)
    it = pipe if pipe is not None else iter(batches)
    try:
        n, settled = warm(step, store, it, a.warmup_cap, fill_host=not preload)
        comb = store.disk.combine if not preload else None
        cycles, phase = 0, 0
        if comb is not None:  # the window starts just after combined write-backs went down ...
            n += to_cycle(step, it, comb, a.warmup_cap)
            if a.phase == "mid":  # ... or half a cycle later (see --phase)
                length = to_cycle(step, it, comb, a.warmup_cap)
                phase = length // 2
                for _ in range(phase):
                    step(it)
                n += length + phase
        settle(store, pipe)
        s0 = snapshot(store, pipe)
        cpu0 = cpu_seconds()
        start = n
        for b in batches[max(0, start - 3):start]:  # the baseline's caches warm too
            base(iter([b]))
        hs = bs = ws = 0.0
        inside0, base_inside0, i = step.inside, base.inside, start
        c = store.counters
        parts0 = (c.lookup_seconds.sum, c.update_seconds.sum, pipe.wait_seconds if pipe else 0.0)
        bg0 = (pipe.prefetch_seconds, pipe.read_ahead_seconds) if pipe else (0.0, 0.0)
        crit0 = critical(coll, pipe)
        finished = False
        since = phase  # steps since combined write-backs last went down
        ab = {"deferred": [0.0, 0], "sync": [0.0, 0]}  # --ab-updates: critical seconds, steps
        blocks = 0
        while not finished:
            if a.ab_updates:  # alternate blocks (deferred first)
                mode = "deferred" if blocks % 2 == 0 else "sync"
                store.deferred_updates = mode == "deferred"
                cb = critical(coll, pipe)
            t0 = time.perf_counter()
            k = 0
            if prof is not None:
                prof.enable()
            while k < BLOCK and not finished:
                held = comb.n if comb is not None else 0
                step(it)
                k += 1
                went = comb is not None and comb.n < held
                cycles += went
                since = 0 if went else since + 1
                finished = i + k - start >= a.steps and (  # whole cycles, ending at the phase it started
                    comb is None or i + k - start >= CYCLE_CAP * a.steps or (cycles >= MIN_CYCLES and since == phase))
            if prof is not None:
                prof.disable()
            if a.ab_updates:
                ab[mode][0] += critical(coll, pipe) - cb
                ab[mode][1] += k
            blocks += 1
            tw = time.perf_counter()
            settle(store, pipe)
            t1 = time.perf_counter()
            for b in batches[i:i + k]:
                base(iter([b]))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            hs, bs, ws, i = hs + t1 - t0, bs + t2 - t1, ws + t1 - tw, i + k
        steps = i - start
        res = figures(s0, snapshot(store, pipe), steps, a.batch, wb, hs, ws)
        cpu1 = cpu_seconds()
        # background CPU a step (the training thread's includes the baseline blocks' steps)
        cpu_ms = {k: round(1e3 * (v - cpu0.get(k, 0.0)) / steps, 3) for k, v in sorted(cpu1.items())
                  if v - cpu0.get(k, 0.0) > 0}
        inside = step.inside - inside0
        crit = critical(coll, pipe) - crit0
        parts = [x - y for x, y in zip((c.lookup_seconds.sum, c.update_seconds.sum,
                                        pipe.wait_seconds if pipe else 0.0), parts0)]
        ps = pipe.stats() if pipe is not None else {}
        bg = [1e3 * (x - y) / steps for x, y in zip((pipe.prefetch_seconds, pipe.read_ahead_seconds) if pipe
                                                   else (0.0, 0.0), bg0)]
    finally:
        if pipe is not None:
            pipe.close()
        store.close()
        shutil.rmtree(path, ignore_errors=True)
        os.sync()  # nor this configuration's in the next one's
    if prof is not None:
        out_file = a.profile.with_name(f"{a.profile.name}.{name.replace('/', '_')}")
        prof.dump_stats(out_file)
        print(f"  {name}: the training thread's profile of the timed steps in {out_file} "
              f"(python -m pstats); top by own time:", file=sys.stderr)
        st = pstats.Stats(prof, stream=sys.stderr)
        st.sort_stats("tottime").print_stats(12)
    ms = res.pop("ms_per_step")
    out = {"over_baseline": round(bs / hs, 4),
           "critical_path_ms": round(1e3 * (crit + ws) / steps, 3),
           "critical_path_no_settle_ms": round(1e3 * crit / steps, 3),
           **({"critical_no_settle_by_updates_ms": {m: round(1e3 * v / max(1, n), 3) for m, (v, n) in ab.items()}}
              if a.ab_updates else {}),
           "embedding_side_ms": round(1e3 * inside / steps, 3),
           "critical_parts_ms": {"lookup": round(1e3 * parts[0] / steps, 3), "update": round(1e3 * parts[1] / steps, 3),
                                 "wait_for_prefetch": round(1e3 * parts[2] / steps, 3),
                                 "block_end_settle": round(1e3 * ws / steps, 3)},
           "baseline_embedding_ms": round(1e3 * (base.inside - base_inside0) / steps, 3),
           "step_ms": round(1e3 * hs / steps, 3), "baseline_step_ms": round(1e3 * bs / steps, 3),
           "dense_ms": a.dense_ms, "bg_ms": ms["bg"],
           "bg_parts_ms": {"prefetch_and_release": round(bg[0], 3), "read_ahead": round(bg[1], 3)},
           "cpu_ms_per_step": cpu_ms,
           # the share of the prefetch thread's work the training thread did not wait for
           "planner_overlap": round(1 - parts[2] * 1e3 / steps / bg[0], 3) if bg[0] > 0 else None, "lmdb_ms": round(ms["lmdb_read"] + ms["lmdb_write"], 3),
           "lmdb_read_ms": ms["lmdb_read"], "lmdb_write_ms": ms["lmdb_write"], "settle_ms": ms["wait"],
           "hit_rates": res["hit_rates"], "rows_per_step": res["rows_per_step"],
           "device_rows": dev, "host_rows": host, "depth": depth, "write_behind": wb,
           "warmup_steps": n, "settled": settled, "timed_steps": steps, "combine_cycles": cycles,
           "window_phase_steps": phase,
           "prefetch_mode": pipe.mode if pipe is not None else None,
           "prefetch": {k: ps[k] for k in ("prefetched_batches", "prefetch_degraded", "late_batches",
                                           "mean_effective_depth") if k in ps}}
    print(f"  {name:18s} x{out['over_baseline']:.3f}  critical {out['critical_path_ms']:.3f} ms "
          f"{out['critical_parts_ms']} (baseline emb {out['baseline_embedding_ms']:.3f})  step {out['step_ms']:.2f} / {out['baseline_step_ms']:.2f} ms"
          f"  dev hit {res['hit_rates']['device']:.3f}  lmdb {out['lmdb_ms']:.2f} ms  bg {out['bg_ms']:.2f} ms  "
          f"pf {out['prefetch']}  warm {n}{'' if settled else '(cap)'}  ({time.perf_counter() - t_start:.1f} s)", file=sys.stderr)
    return out


def run_workload(a, wl, wait: Wait, kinds: list[str]) -> dict:
    # warm-up, the cycle alignment (two cycles and a half at most) and the timed window
    n_batches = 4 * a.warmup_cap + CYCLE_CAP * a.steps + BLOCK + a.depth + 16
    batches = make_batches(wl, n_batches, a.batch)
    W = working_set(wl, batches)
    total = sum(t.num_rows for t in wl.tables)
    print(f"{wl.name}: {len(wl.tables)} tables, {total} rows x dim {a.dim}, batch {a.batch} x {wl.pooling}; "
          f"W = {W:.0f}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f"hiermem-bench-pipeline-{wl.name}-"))
    out = {}
    try:
        plain = PlainEmbeddingBags(wl.tables)
        ck = template(wl, plain, tmp)
        base = Step(plain.to(a.device), len(wl.tables), a.dim, wait, torch.optim.SGD(plain.parameters(), lr=0.05),
                    device=a.device, move_sparse=True, real=a.real_dense)
        ctx = {"args": a, "wl": wl, "batches": batches, "tmp": tmp, "ck": ck, "base": base, "wait": wait}
        dev = int(2 * W)
        for kind in kinds:
            if kind == "device":
                out["device"] = run_config(ctx, f"{wl.name}/device", total + 1024, 1024, 0, False, True)
            elif kind == "host":
                out["host"] = run_config(ctx, f"{wl.name}/host", dev, total + 1024, a.depth, False, True)
            elif kind == "disk":
                out["disk"] = run_config(ctx, f"{wl.name}/disk", dev, 8 * dev, a.depth, a.write_behind, False)
        for v in out.values():
            v["W"] = round(W, 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows and steps (< 120 s)")
    ap.add_argument("--dense-ms", type=float, default=4.0, help="the dense part's wait per step")
    ap.add_argument("--wait", choices=("spin", "sleep"), default="spin", help="how the dense part waits")
    ap.add_argument("--rows", type=int, default=None, help="rows per Zipf table (default 500k, quick 120k)")
    ap.add_argument("--criteo-rows", type=int, default=None, help="Criteo rows in all (default 4M, quick 400k)")
    ap.add_argument("--dim", type=int, default=16, help="embedding dimension")
    ap.add_argument("--batch", type=int, default=None, help="samples per batch (default 512, quick 256)")
    ap.add_argument("--pooling", type=int, default=4, help="ids per bag, Zipf workload")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 100, quick 40)")
    ap.add_argument("--warmup-cap", type=int, default=None, help="most warm-up steps (default 300, quick 120)")
    ap.add_argument("--depth", type=int, default=DEPTH, help="prefetch depth of the host and disk configurations")
    ap.add_argument("--gil-slice", type=float, default=hm.nn.pipeline.GIL_SLICE,
                    help="the pipeline's switch interval while its threads run (s; 0: the interpreter's)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--write-behind", default="combined", choices=("combined", "on", "off"),
                    help="disk-backed: write-backs combined and committed by the writer thread, each "
                         "committed by it, or committed by the evicting thread")
    ap.add_argument("--phase", default="mid", choices=("mid", "aligned"),
                    help="combined write-backs: the timed window (and so each block's end, where the block waits "
                         "for its background work) starts and ends half a cycle after they go down (mid), or "
                         "just after (aligned: every block of ~one cycle then ends by waiting for that cycle's "
                         "whole commit, which continuous training overlaps with the next steps)")
    ap.add_argument("--configs", nargs="+", default=["device", "host", "disk", "criteo_disk"],
                    choices=("device", "host", "disk", "criteo_disk"), help="which configurations")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model and device tier live")
    ap.add_argument("--real-dense", action="store_true", help="bench_train's DLRM dense part instead of the wait")
    ap.add_argument("--sync-updates", action="store_true",
                    help="run the fused updates on the training thread (the store's deferred_updates off)")
    ap.add_argument("--ab-updates", action="store_true",
                    help="alternate timed blocks with the fused updates deferred and on the training thread, "
                         "and report each one's critical path (critical_no_settle_by_updates_ms)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON object here")
    ap.add_argument("--profile", type=Path, default=None,
                    help="cProfile the training thread's timed steps; stats to PROFILE.<config> (slows them: "
                         "the ratios of a profiled run mean little)")
    a = ap.parse_args(argv)
    a.write_behind = {"combined": "combined", "on": True, "off": False}[a.write_behind]
    a.rows = a.rows or (120_000 if a.quick else 500_000)
    a.criteo_rows = a.criteo_rows or (400_000 if a.quick else 4_000_000)
    a.batch = a.batch or (256 if a.quick else 512)
    a.steps = a.steps or (40 if a.quick else 100)
    a.steps = max(BLOCK, (a.steps + BLOCK - 1) // BLOCK * BLOCK)
    a.warmup_cap = a.warmup_cap or (120 if a.quick else 300)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    wait = Wait(0.0 if a.real_dense else a.dense_ms, a.wait)
    free = gil_free(Wait(1.0, a.wait))
    print(f"dense part: {'real DLRM' if a.real_dense else f'{a.wait} {a.dense_ms} ms'}; a Python thread runs at "
          f"{free:.2f}x its alone speed during the wait (GIL free); torch threads {a.threads}; device {a.device}",
          file=sys.stderr)
    res: dict = {}
    zk = [k for k in a.configs if k in ("device", "host", "disk")]
    if zk:
        res.update({f"zipf1.05/{k}": v for k, v in run_workload(
            a, zipf_workload(1.05, a.rows, a.dim, a.pooling), wait, zk).items()})
    if "criteo_disk" in a.configs:
        res.update({f"criteo/{k}": v for k, v in run_workload(a, criteo_workload(a.criteo_rows, a.dim), wait,
                                                              ["disk"]).items()})

    def get(name, key):
        return res[name][key] if name in res else None
    host_cp = get("zipf1.05/host", "critical_path_ms")
    summary = {"host_over_baseline": get("zipf1.05/host", "over_baseline"),
               "disk_prefetch_over_baseline": get("zipf1.05/disk", "over_baseline"),
               "criteo_disk_prefetch_over_baseline": get("criteo/disk", "over_baseline"),
               "device_over_baseline": get("zipf1.05/device", "over_baseline"),
               "critical_path_share_host": (round(host_cp / a.dense_ms, 4)
                                            if host_cp is not None and a.dense_ms > 0 else None),
               "dense_ms": a.dense_ms, "wait": "real" if a.real_dense else a.wait, "gil_free_during_wait": round(free, 3),
               "device": a.device, "torch_threads": a.threads, "seconds": round(time.perf_counter() - t0, 1),
               "configs": res}
    line = json.dumps(summary)
    if a.json:
        a.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
