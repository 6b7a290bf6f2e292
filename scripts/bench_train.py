"""DLRM training through hiermem against in-memory nn.EmbeddingBag: steady state, caches
sized by the working set, where each step's time goes.  One run, one machine.

Workloads (batches pre-generated, shared by every configuration and the baseline):
zipf1.05 and zipf1.2: 8 tables, ``--pooling`` Zipf ids per bag.  criteo: 26 tables, one
id per bag, sized after the 26 categorical features of the Criteo Kaggle Display
Advertising Challenge (DAC) train.txt, C1..C26 = 1460, 583, 10131227, 2202608, 305, 24,
12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547,
18, 15, 286181, 105, 142572 distinct values (33,762,577 in all; as reported by the
Kaggle preprocessing of facebookresearch/dlrm and reproduced across DLRM/CTR code),
scaled by one factor to ``--criteo-rows`` (no table below min(cardinality, 100) rows);
each table's Zipf exponent puts 90% of its accesses on its top 1% of rows.  The real
head in ../shared/data/criteo-dac-head8k, when present, is read for comparison only.

Sizing: W = mean distinct rows per batch; device tier m x W (``--sizes``, 1 2 4 8;
quick 1 2), host tier 8x the device tier, tables >= 50x the device tier, the rest on
LMDB (every row starts there: one template restored per configuration).  Per size:
``host_pf`` (every row in the host tier, prefetch depth 2), ``disk`` (no prefetch),
``disk_pf`` (depth 2), and at ``--write-behind-sizes`` ``disk_wb``/``disk_pf_wb``; per
workload ``device`` (every row on the device tier) and ``cold_pf`` (2 x W, first 30
steps from empty tiers with LMDB's pages dropped, depth 2; quick: zipf1.05 only).

Steady state: untimed warm-up until the device hit rate of a 20-step window moves by
< 0.5 points from the window before and (disk configurations) the host tier has started
evicting to LMDB (capped; reported), then ``--steps`` timed steps in
blocks of 5 alternating with the baseline (nn.EmbeddingBag(sparse=True) + SGD, same
model, same batches), so the machine's noise hits both; a ratio is the baseline's time
over hiermem's, summed over the blocks (``over_baseline``; the median of the blocks'
ratios is ``over_baseline_median``).  A hiermem block ends by waiting for the background
work it started.  Where the disk tier combines write-backs (``StoreConfig.write_combine``,
the default) one step in many commits them all, so the window holds whole cycles: it
starts just after a commit and ends with one, after at least ``--steps`` steps and
``MIN_COMMITS`` commits (``commits_timed``; capped at ``WINDOW_CAP`` x ``--steps``).

Prefetch over no prefetch and write-behind over synchronous write-backs are measured as
pairs (``paired``): both configurations warm up, then train the same batches in
alternating blocks in the same run, and the ratio is the median of the blocks' ratios
(the configurations' own ratios to the baseline, measured apart, are the ``_unpaired``
figures: on a noisy machine they differ by +-10% even where both run the same code).  A
control pair (``paired_noise``: the first workload's disk configuration against itself)
shows how far from 1.0 a pair of identical code lands here.

LMDB bound (``*_lmdb_bound``): the most a design that moves each row crossing the disk
tier through LMDB once per crossing can reach, from the configuration's own LMDB time
per step: ``serial`` = baseline step / (baseline step + LMDB time), ``overlapped`` =
baseline step / max(baseline step, LMDB time) (every LMDB call hidden behind the step on
another core).

Time split (ms/step): ``dense`` = step - the training thread's store calls - ``wait``
(for the prefetch thread, and at block ends); ``lmdb_read``/``lmdb_write``: the disk
tier's timers (any thread); ``copies``: the store's timer around each placement's record
copies between device and host tiers (any thread; on CUDA the copies run on a side stream
and this times gathering and issuing them); ``placement``: store calls (any thread) - copies - the
LMDB time inside them; ``bg``: the prefetch and read-ahead threads' store time.  With
prefetch the parts overlap and do not add up to the step.  Prefetch and write-behind run as the
library decides by default (``PrefetchPipeline(background="auto")``,
``StoreConfig(write_behind="auto")``; :mod:`hiermem.store.overlap`): on background threads where
they can overlap the step (a GPU, or a core free beside torch's intra-op threads), else as
foreground work (no prefetch: each lookup places its own rows; write-backs committed in
the step), as on 2 cores; ``HIERMEM_BACKGROUND=threads|inline`` forces the pipeline's
mode.  Each configuration reports ``prefetch_background`` (threads, inline or
foreground) and ``write_behind`` with its reason.  The PROJECTION (never mixed
with measurements) feeds hiermem.sim.cost with this run's LMDB cost per row and a GPU
host's published bandwidths.

    python scripts/bench_train.py --quick [--png PATH]   (< 90 s on an idle 2-core host)
    python scripts/bench_train.py                         (full: 3 workloads x 1 2 4 8 W)
    python scripts/bench_train.py --quick --device cuda   (model, baseline and device tier on the GPU;
                                                           ids stay on the CPU, as from a data loader)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import hiermem as hm  # noqa: E402
from hiermem.nn.data import ZipfIds, shared_data_dir  # noqa: E402
from hiermem.nn.dlrm import DLRM, PlainEmbeddingBags  # noqa: E402
from hiermem.sim.cost import CostModel  # noqa: E402
from hiermem.observe.stats import IO, STAT_TIERS, Stat  # noqa: E402
from hiermem.types import Tier  # noqa: E402

CRITEO_KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
# published peak figures of a GPU host, for the projection only
GPU_HBM_BPS = 4.8e12  # H200 HBM3e
GPU_PCIE_BPS = 55e9  # PCIe Gen5 x16, effective
GPU_NVME_BPS = 7e9  # one Gen4/5 NVMe drive, sequential read (also used for writes)
WINDOW, TOLERANCE, MIN_WARMUP = 20, 0.005, 40
DEPTH = 2
BLOCK = 5  # timed steps per block, alternating hiermem and baseline
MIN_COMMITS = 2  # combined write-back commits a timed window holds at least (whole cycles)
WINDOW_CAP = 12  # ... within this many times --steps
PAIR_STEPS = 4  # a pair (paired()) times this many x --steps: 4x the blocks of a configuration, half its noise


@dataclass(frozen=True)
class Workload:
    """Tables, one id sampler per table, and ids per bag."""

    name: str
    tables: tuple
    samplers: tuple
    pooling: int


def top_share(n: int, alpha: float, top: float = 0.01) -> float:
    """Share of accesses that the top ``top`` fraction of ``n`` Zipf(``alpha``) ranks take."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return float(w[:max(1, int(round(top * n)))].sum() / w.sum())


def alpha_for_share(n: int, share: float = 0.9) -> float:
    """Zipf exponent at which the top 1% of ``n`` rows take ``share`` of accesses (bisection)."""
    lo, hi = 0.1, 8.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if top_share(n, mid) < share else (lo, mid)
    return (lo + hi) / 2


def criteo_workload(total_rows: int, dim: int, seed: int = 0) -> Workload:
    """26 tables scaled from the Criteo Kaggle cardinalities, 1% of rows -> 90% of accesses."""
    s = total_rows / sum(CRITEO_KAGGLE)
    rows = [max(min(c, 100), int(round(c * s))) for c in CRITEO_KAGGLE]
    tables = tuple(hm.TableSpec(f"C{i + 1}", r, dim) for i, r in enumerate(rows))
    samplers = tuple(ZipfIds(r, alpha_for_share(r), seed=seed + i) for i, r in enumerate(rows))
    return Workload("criteo", tables, samplers, 1)


def zipf_workload(alpha: float, rows: int, dim: int, pooling: int, seed: int = 0) -> Workload:
    """8 tables of ``rows`` rows, Zipf(``alpha``) ids."""
    tables = tuple(hm.TableSpec(f"t{i}", rows, dim) for i in range(8))
    return Workload(f"zipf{alpha:g}", tables, tuple(ZipfIds(rows, alpha, seed=seed + i) for i in range(8)), pooling)


def real_criteo_share() -> float | None:
    """Top-1%-of-ids access share of the real Criteo head (None when the data is absent)."""
    d = shared_data_dir()
    f = d / "criteo-dac-head8k" / "cat_ids.npy" if d is not None else None
    if f is None or not f.is_file():
        return None
    c = np.load(f, allow_pickle=False).astype(np.int64)
    glob = (c + np.concatenate(([0], np.cumsum(c.max(0) + 1)[:-1])))[c >= 0]
    counts = np.sort(np.bincount(glob))[::-1]
    counts = counts[counts > 0]
    return float(counts[:max(1, len(counts) // 100)].sum() / counts.sum())


def make_batches(wl: Workload, n: int, batch: int, seed: int = 0) -> list:
    """``n`` batches of (dense [B, 13], SparseFeatures, labels [B])."""
    rng = np.random.default_rng(seed)
    lengths = torch.full((len(wl.tables) * batch,), wl.pooling, dtype=torch.int64)
    keys = tuple(t.name for t in wl.tables)
    out = []
    for _ in range(n):
        vals = torch.from_numpy(np.concatenate([z(batch * wl.pooling) for z in wl.samplers]))
        out.append((torch.from_numpy(rng.standard_normal((batch, 13), dtype=np.float32)),
                    hm.SparseFeatures(keys, vals, lengths),
                    torch.from_numpy((rng.random(batch) < 0.25).astype(np.float32))))
    return out


def working_set(wl: Workload, batches: list) -> float:
    """W: mean distinct rows (over all tables) per batch."""
    off = torch.tensor(np.cumsum([0] + [t.num_rows for t in wl.tables[:-1]]))
    return float(np.mean([torch.unique(f.values + torch.repeat_interleave(off, f.key_lengths())).numel()
                          for _, f, _ in batches[:50]]))


class Trainer:
    """One model + optimizers (dense SGD, and ``emb_opt`` for plain tables); ``step`` trains a batch.

    On ``device`` cuda the model runs there; ``move_sparse``: the ids go there too (the
    plain tables; a hiermem collection takes them on the CPU and moves what it needs)."""

    def __init__(self, emb: nn.Module, n_tables: int, dim: int, emb_opt=None, device: str = "cpu",
                 move_sparse: bool = False):
        torch.manual_seed(1)
        self.model = DLRM(emb, n_tables, dim).to(device)
        dense = torch.optim.SGD(self.model.dense_parameters(), lr=0.01)
        self.opts, self.loss_fn = [o for o in (dense, emb_opt) if o is not None], nn.BCEWithLogitsLoss()
        self.device, self.move_sparse = torch.device(device), move_sparse and device != "cpu"

    def step(self, batch) -> None:
        dense, f, y = batch
        if self.device.type != "cpu":
            dense, y = dense.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            f = f.to(self.device) if self.move_sparse else f
        loss = self.loss_fn(self.model(dense, f), y)
        for o in self.opts:
            o.zero_grad()
        loss.backward()
        for o in self.opts:
            o.step()


def sync() -> None:
    """Wait for the GPU's queued work (timing a block; a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def settle(store, pipe) -> None:
    """Wait for the background work already started: prefetch, read-ahead, write-behind
    (and the GPU's queued kernels)."""
    if pipe is not None:
        pipe.wait_idle()
    store.disk.drain()  # the write-behind queue (a no-op without it)
    sync()


def commits(store) -> int:
    """LMDB write transactions the store's disk tier has committed so far."""
    return store.disk.durations()[1].count


def combines(store) -> bool:
    """Whether the disk tier holds write-backs for a later, combined commit (and the
    store has written rows down: configurations that never write hold nothing)."""
    return store.disk.combine is not None and int(store.counters.io[IO.BYTES_HOST_TO_DISK]) > 0


def to_commit(tr: Trainer, it, store, cap: int) -> int:
    """Untimed steps until one commits the combined write-backs (a timed window then
    starts with a whole cycle); the steps taken."""
    c0, n = commits(store), 0
    while combines(store) and commits(store) == c0 and n < cap:
        tr.step(next(it))
        n += 1
    return n


def timed_blocks(tr: Trainer, it, store, pipe, base: Trainer, batches: list, start: int, steps: int,
                 t_first: float | None = None) -> tuple[float, float, float, float, int, int]:
    """Seconds of at least ``steps`` hiermem steps and of the baseline over the same
    batches, in alternating blocks of ``BLOCK`` (the machine's noise hits both alike).
    Each hiermem block ends by waiting for its background work, so none of it runs during
    a baseline block; ``t_first``: when the first block's clock started (cold start:
    before the pipeline was built).  With combined write-backs the window goes on until
    ``MIN_COMMITS`` commits, and ends with a step that committed.  Returns (hiermem s,
    baseline s, s of those waits, the median of the blocks' hiermem-over-baseline rates,
    steps timed, commits in them)."""
    for b in batches[max(0, start - 3):start] or batches[-3:]:
        base.step(b)
    sync()
    hs = bs = ws = 0.0
    ratios = []
    cycles = combines(store) and t_first is None
    c0, i, finished = commits(store), start, False
    while not finished:
        t0 = t_first if t_first is not None and i == start else time.perf_counter()
        n = 0
        while n < BLOCK and not finished:
            before = commits(store)
            tr.step(next(it))
            n, i = n + 1, i + 1
            finished = i - start >= steps and (not cycles or i - start >= WINDOW_CAP * steps or (
                commits(store) - c0 >= MIN_COMMITS and commits(store) > before))
        tw = time.perf_counter()
        settle(store, pipe)
        t1 = time.perf_counter()
        ws += t1 - tw
        for b in batches[i - n:i]:
            base.step(b)
        sync()
        t2 = time.perf_counter()
        hs, bs = hs + t1 - t0, bs + t2 - t1
        ratios.append((t2 - t1) / (t1 - t0))
    return hs, bs, ws, float(np.median(ratios)), i - start, commits(store) - c0


def snapshot(store, pipe) -> dict:
    """Counters and timers of the store (and pipeline) now, as plain numbers."""
    c = store.counters
    rd, wr = store.disk.durations()
    return {"table": c.table.sum(0).clone(), "io": c.io.clone(),
            "fg": c.lookup_seconds.sum + c.update_seconds.sum, "copy": c.copy_seconds.sum, "read": rd.sum,
            "write": wr.sum,
            "wait": pipe.wait_seconds if pipe else 0.0, "pf": pipe.prefetch_seconds if pipe else 0.0,
            "ra": pipe.read_ahead_seconds if pipe else 0.0}


def device_counts(store) -> tuple[int, int]:
    """Device tier (lookups, misses) so far."""
    t = store.counters.table[:, Tier.DEVICE]
    return int(t[:, Stat.LOOKUPS].sum()), int(t[:, Stat.MISSES].sum())


def figures(a: dict, b: dict, steps: int, batch: int, wb: bool, seconds: float,
            settled: float, inline: bool = False) -> dict:
    """Per-step figures between snapshots ``a`` and ``b``: ``seconds`` of timed steps, of
    which ``settled`` waited at block ends for background work."""
    tab, io = b["table"] - a["table"], b["io"] - a["io"]
    d = {k: b[k] - a[k] for k in ("fg", "copy", "read", "write", "wait", "pf", "ra")}
    d["t"], d["wait"] = seconds, d["wait"] + settled
    hit = {t.label: round(int(tab[t, Stat.HITS]) / max(1, int(tab[t, Stat.LOOKUPS])), 4) for t in STAT_TIERS}
    rows = {"host_to_device": int(tab[Tier.DEVICE, Stat.MISSES]), "device_to_host": int(tab[Tier.DEVICE, Stat.EVICTIONS]),
            "disk_to_host": int(tab[Tier.DISK, Stat.LOOKUPS]), "host_to_disk": int(tab[Tier.HOST, Stat.WRITEBACKS])}
    copies = d["copy"]
    write_in_store = 0.0 if wb else d["write"]
    place = max(0.0, d["fg"] + d["pf"] - copies - max(0.0, d["read"] - d["ra"]) - write_in_store)
    on_thread = d["pf"] + d["ra"] if inline else 0.0  # inline prefetch runs on the training thread
    ms = {"step": d["t"], "dense": max(0.0, d["t"] - d["fg"] - d["wait"] - on_thread), "placement": place, "copies": copies,
          "lmdb_read": d["read"], "lmdb_write": d["write"], "wait": d["wait"], "bg": d["pf"] + d["ra"]}
    return {"samples_per_s": steps * batch / d["t"], "hit_rates": hit,
            "rows_per_step": {k: round(v / steps, 1) for k, v in rows.items()},
            "ms_per_step": {k: round(1e3 * v / steps, 2) for k, v in ms.items()},
            "bytes_per_step": {k.name.lower(): int(io[k]) / steps for k in (
                IO.BYTES_HOST_TO_DEVICE, IO.BYTES_DEVICE_TO_HOST, IO.BYTES_DISK_TO_HOST, IO.BYTES_HOST_TO_DISK)}}


def warm(tr: Trainer, store, it, cap: int, fill_host: bool) -> tuple[int, bool]:
    """Untimed steps until the 20-step device hit rate settles and, with ``fill_host``, the
    host tier has started evicting to LMDB (until then no step writes); (steps, settled)."""
    prev, base, n = None, device_counts(store), 0
    while n < cap:
        tr.step(next(it))
        n += 1
        if n % WINDOW == 0:
            now = device_counts(store)
            h = 1 - (now[1] - base[1]) / max(1, now[0] - base[0])
            full = not fill_host or int(store.counters.table[:, Tier.HOST, Stat.EVICTIONS].sum()) > 0
            settled = getattr(it, "mode_settled", True)  # an "auto" pipeline has measured its mode
            if prev is not None and abs(h - prev) < TOLERANCE and n >= MIN_WARMUP and full and settled:
                return n, True
            prev, base = h, now
    return n, False


def open_store(ck: Path, path: Path, wl: Workload, dev: int, host: int, wb: bool | str, preload: bool,
               device: str = "cpu", policy: str | None = None):
    """A store restored from the template, every row loaded when ``preload`` (the timed
    figures are differences of counters, so the loading lookups count in none)."""
    more = {"policy": policy} if policy else {}
    store = hm.HierarchicalStore.restore(ck, path, device_rows=dev, host_rows=host, write_behind=wb, device=device,
                                         **more)
    if preload:
        for t in wl.tables:
            for i in range(0, t.num_rows, 1 << 16):
                store.lookup(t.name, torch.arange(i, min(t.num_rows, i + (1 << 16))))
    return store


def run_config(ctx: dict, wl: Workload, name: str, dev: int, host: int, depth: int, wb: bool | str = False,
               preload: bool = False, cold: bool = False, policy: str | None = None) -> dict:
    """Train one configuration (warm-up, then timed steps) and its interleaved baseline."""
    a, batches, t_start = ctx["args"], ctx["batches"], time.perf_counter()
    path = ctx["tmp"] / name.replace("/", "_").replace("@", "_")
    store = open_store(ctx["ck"], path, wl, dev, host, wb, preload, a.device, policy)
    if cold:
        drop_page_cache(path)
    tr = Trainer(hm.CachedEmbeddingBagCollection(wl.tables, store=store), len(wl.tables), a.dim, device=a.device)
    s0 = snapshot(store, None)
    t_pipe = time.perf_counter()
    pipe = hm.PrefetchPipeline(iter(batches), tr.model.embeddings, depth=depth) if depth else None
    it = pipe if pipe is not None else iter(batches)
    background = pipe.mode if pipe is not None else None
    wb_on, wb_why = store.write_behind, store.write_behind_reason
    try:
        n, settled = (0, True) if cold else warm(tr, store, it, a.warmup_cap, fill_host=not preload)
        n_align = 0
        if not cold:
            n_align = to_commit(tr, it, store, a.warmup_cap)  # the window starts with a whole commit cycle
            settle(store, pipe)
            s0 = snapshot(store, pipe)
        combines_rows = store.disk.combine.limit if combines(store) else 0
        hs, bs, ws, med, steps, ncommit = timed_blocks(tr, it, store, pipe, ctx["base"], batches, n + n_align, a.steps,
                                                       t_pipe if cold else None)
        res = figures(s0, snapshot(store, pipe), steps, a.batch, wb_on, hs, ws, background == "inline")
    finally:
        if pipe is not None:
            pipe.close()
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    base = steps * a.batch / bs
    res.update(baseline_samples_per_s=base, over_baseline=res["samples_per_s"] / base, over_baseline_median=med,
               timed_steps=steps, commits_timed=ncommit, write_combine=combines_rows, warmup_steps=n,
               align_steps=n_align, settled=settled,
               device_rows=dev, host_rows=host, prefetch_depth=depth, write_behind=wb_on,
               write_behind_asked=wb, write_behind_reason=wb_why, prefetch_background=background)
    cyc = f"  +{n_align} to a commit; {steps} steps, {ncommit} commits" if combines_rows and not cold else ""
    print(f"  {name:28s} x{res['over_baseline']:.3f}  warm {n:3d}{'' if settled else '(cap)'}  "
          f"dev hit {res['hit_rates']['device']:.3f}  ({time.perf_counter() - t_start:.1f} s){cyc}", file=sys.stderr)
    return res


def paired(ctx: dict, wl: Workload, name: str, a_cfg: tuple, b_cfg: tuple) -> dict:
    """Configuration A's speed over configuration B's, measured as a pair: both warm up
    (each until it settles, then the one behind steps on to the other's batch), then
    train the same batches in alternating blocks of ``BLOCK`` steps (A then B, B then A,
    ...), each block ending by waiting for its background work.  ``*_cfg``: (device rows,
    host rows, prefetch depth, write_behind).  Returns the median of the blocks' ratios
    (B's time over A's: > 1 when A is faster) and the settings each resolved to."""
    a, batches = ctx["args"], ctx["batches"]
    runs = []
    try:
        for tag, (dev, host, depth, wb) in (("a", a_cfg), ("b", b_cfg)):
            path = ctx["tmp"] / (name.replace("/", "_").replace("@", "_") + "-pair-" + tag)
            store = open_store(ctx["ck"], path, wl, dev, host, wb, False, a.device)
            runs.append({"store": store, "path": path, "pipe": None})
            tr = Trainer(hm.CachedEmbeddingBagCollection(wl.tables, store=store), len(wl.tables), a.dim,
                         device=a.device)
            pipe = hm.PrefetchPipeline(iter(batches), tr.model.embeddings, depth=depth) if depth else None
            it = pipe if pipe is not None else iter(batches)
            n, _ = warm(tr, store, it, a.warmup_cap, fill_host=True)
            runs[-1].update(tr=tr, pipe=pipe, it=it, n=n)
        start = max(r["n"] for r in runs)
        for r in runs:  # both at the same batch
            for _ in range(start - r["n"]):
                r["tr"].step(next(r["it"]))
            settle(r["store"], r["pipe"])
        ratios = []
        steps = PAIR_STEPS * a.steps
        for j, i in enumerate(range(start, start + steps, BLOCK)):
            t = {}
            for r in (runs if j % 2 == 0 else runs[::-1]):
                t0 = time.perf_counter()
                for _ in range(min(BLOCK, start + steps - i)):
                    r["tr"].step(next(r["it"]))
                settle(r["store"], r["pipe"])
                t[id(r)] = time.perf_counter() - t0
            ratios.append(t[id(runs[1])] / t[id(runs[0])])
        modes = [(r["pipe"].mode if r["pipe"] is not None else None, r["store"].write_behind) for r in runs]
    finally:
        for r in runs:
            if r["pipe"] is not None:
                r["pipe"].close()
            r["store"].close()
            shutil.rmtree(r["path"], ignore_errors=True)
    med = float(np.median(ratios))
    print(f"  {name:28s} paired x{med:.3f}  (blocks {min(ratios):.3f}..{max(ratios):.3f}; prefetch/write-behind "
          f"{modes[0]} over {modes[1]})", file=sys.stderr)
    return {"ratio": med, "block_ratios": [round(x, 4) for x in ratios], "a": modes[0], "b": modes[1]}


def drop_page_cache(path: Path) -> None:
    """Drop the LMDB files' pages from the page cache (posix_fadvise DONTNEED)."""
    for f in path.glob("*.mdb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def template(wl: Workload, plain: PlainEmbeddingBags, tmp: Path) -> Path:
    """A checkpoint holding every row of ``plain`` in LMDB (restored per configuration)."""
    m = hm.CachedEmbeddingBagCollection.from_embedding_bags(
        dict(plain.bags.items()), hm.StoreConfig(path=tmp / "live", device_rows=1024, host_rows=1024,
                                                 optimizer=hm.SGD(lr=0.05), device="cpu"))
    ck = m.checkpoint(tmp / "template")
    m.store.close()
    shutil.rmtree(tmp / "live")
    return ck


def run_workload(a, wl: Workload, sizes: list[int], wb_sizes: list[int]) -> tuple[dict, float, dict]:
    """Every configuration of one workload; ({config name: figures}, W, {pair: paired ratio})."""
    n_batches = 2 * a.warmup_cap + max(PAIR_STEPS, WINDOW_CAP) * a.steps + DEPTH + 8  # warm-up, alignment, window
    batches = make_batches(wl, n_batches, a.batch)
    W = working_set(wl, batches)
    total = sum(t.num_rows for t in wl.tables)
    print(f"{wl.name}: {len(wl.tables)} tables, {total} rows x dim {a.dim}, batch {a.batch} x {wl.pooling}; "
          f"W = {W:.0f} distinct rows per batch; tables = {total / (max(sizes) * W):.0f}x the largest device tier",
          file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f"hiermem-bench-train-{wl.name}-"))
    out, pairs_out = {}, {}
    try:
        plain = PlainEmbeddingBags(wl.tables)
        t0 = time.perf_counter()
        ck = template(wl, plain, tmp)  # from the CPU weights, before the baseline moves them
        base = Trainer(plain, len(wl.tables), a.dim, torch.optim.SGD(plain.parameters(), lr=0.05), device=a.device,
                       move_sparse=True)
        ctx = {"args": a, "batches": batches, "tmp": tmp, "ck": ck, "base": base}
        print(f"  LMDB template of {total} rows: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        out[f"{wl.name}/device"] = run_config(ctx, wl, f"{wl.name}/device", total + 1024, 1024, 0, preload=True)
        for m in sizes:
            dev = int(m * W)
            for kind, host, depth, wb, pre in (("host_pf", total + 1024, DEPTH, False, True),
                                               ("disk", 8 * dev, 0, False, False),
                                               ("disk_pf", 8 * dev, DEPTH, False, False),
                                               *((("disk_wb", 8 * dev, 0, "auto", False),
                                                  ("disk_pf_wb", 8 * dev, DEPTH, "auto", False)) if m in wb_sizes else ())):
                name = f"{wl.name}/{kind}@{m}W"
                out[name] = run_config(ctx, wl, name, dev, host, depth, wb=wb, preload=pre)
        for m in wb_sizes or sizes[-1:]:  # the never-hurts ratios, measured as pairs
            dev = int(m * W)
            pairs = [("prefetch", (dev, 8 * dev, DEPTH, False), (dev, 8 * dev, 0, False))]
            if m in wb_sizes:
                pairs.append(("write_behind", (dev, 8 * dev, 0, "auto"), (dev, 8 * dev, 0, False)))
            if a.cold:  # the control: one configuration against itself shows the pairs' noise
                pairs.append(("same", (dev, 8 * dev, 0, False), (dev, 8 * dev, 0, False)))
            for what, ca, cb in pairs:
                pairs_out[f"{wl.name}/{what}@{m}W"] = paired(ctx, wl, f"{wl.name}/{what}@{m}W", ca, cb)
        if a.cold and a.policies:  # the eviction policies on the disk-backed step (the template's is lru)
            dev = int(2 * W)
            for pol in a.policies:
                name = f"{wl.name}/disk_pf@2W[{pol}]"
                out[name] = run_config(ctx, wl, name, dev, 8 * dev, DEPTH, policy=pol)
        if a.cold:
            dev = int(2 * W)
            out[f"{wl.name}/cold_pf@2W"] = run_config(ctx, wl, f"{wl.name}/cold_pf@2W", dev, 8 * dev, DEPTH, cold=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, W, pairs_out


def ratio(res: dict, num: str, den: str) -> float | None:
    """``res[num]`` over ``res[den]``, each as a ratio to its own interleaved baseline (None
    if either is missing)."""
    if num not in res or den not in res:
        return None
    return res[num]["over_baseline"] / res[den]["over_baseline"]


def worst(res: dict, pairs: tuple) -> float | None:
    """The smallest ratio of configuration kinds ``(num, den)`` over every workload and size."""
    r = [ratio(res, k.replace(pairs[i][1], pairs[i][0]), k) for k in res for i in range(len(pairs))
         if k.split("/")[1].startswith(pairs[i][1] + "@")]
    r = [x for x in r if x is not None]
    return min(r) if r else None


def projection(res: dict, row_bytes: int) -> dict:
    """Per disk configuration, the projected I/O per step on a GPU host (hiermem.sim.cost)."""
    def per_row(part: str, rows: str) -> float:
        v = [c["ms_per_step"][part] / 1e3 / c["rows_per_step"][rows] for k, c in res.items()
             if "/disk" in k and c["rows_per_step"][rows] > 0]
        return float(np.median(v)) if v else 0.0
    rd, wr = per_row("lmdb_read", "disk_to_host"), per_row("lmdb_write", "host_to_disk")
    model = CostModel(host_to_device=GPU_PCIE_BPS, device_to_host=GPU_PCIE_BPS,
                      disk_read=1 / (rd / row_bytes + 1 / GPU_NVME_BPS),
                      disk_write=1 / (wr / row_bytes + 1 / GPU_NVME_BPS),
                      device_accesses_per_s=GPU_HBM_BPS / row_bytes)
    out = {"lmdb_read_us_per_row_here": round(rd * 1e6, 3), "lmdb_write_us_per_row_here": round(wr * 1e6, 3)}
    for k, c in res.items():
        if "/disk" not in k or c["write_behind_asked"]:
            continue
        b = c["bytes_per_step"]
        st = model.estimate(1, 0, b["bytes_host_to_device"], b["bytes_device_to_host"], b["bytes_disk_to_host"],
                            b["bytes_host_to_disk"], prefetch_depth=DEPTH)
        out[k] = {"hide_disk_at_step_ms": round(1e3 * (st.disk_read + st.disk_write), 3),
                  "hide_all_io_at_step_ms": round(1e3 * st.io, 3)}
    return out


def plot(res: dict, names: list[str], sizes: list[int], png: Path, note: str) -> None:
    """Throughput over baseline vs device-tier size, a line per configuration, a panel per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, wl in zip(axes[0], names):
        for kind, label, style in (("host_pf", "host-backed, prefetch 2", "o-"), ("disk", "disk, no prefetch", "s-"),
                                   ("disk_pf", "disk, prefetch 2", "^-"), ("disk_wb", "disk, write-behind", "s:"),
                                   ("disk_pf_wb", "disk, prefetch 2 + write-behind", "^:")):
            pts = [(m, res[f"{wl}/{kind}@{m}W"]["over_baseline"]) for m in sizes if f"{wl}/{kind}@{m}W" in res]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        cold = [(k.split("@")[1][:-1], c["over_baseline"]) for k, c in res.items() if k.startswith(f"{wl}/cold_pf@")]
        if cold:
            ax.plot([int(m) for m, _ in cold], [v for _, v in cold], "kx", label="cold start, prefetch 2 (30 steps)")
        if f"{wl}/device" in res:
            ax.axhline(res[f"{wl}/device"]["over_baseline"], color="grey", ls="--", label="all rows on device")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{m}W" for m in sizes])
        ax.set_ylim(bottom=0)
        ax.set(title=wl, xlabel="device tier (multiples of W, distinct rows per batch)",
               ylabel="samples/s over in-memory nn.EmbeddingBag")
        ax.legend(fontsize=7)
    fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def print_table(res: dict) -> None:
    """One row per configuration: ratio, warm-up, hit rates, rows crossing, ms split (stderr)."""
    p = lambda s: print(s, file=sys.stderr)  # noqa: E731
    p(f"\n{'configuration':26s} {'x base':>6s} {'warm':>4s} {'hit dev/host/disk':>17s} "
      f"{'rows/step h>d d>h k>h h>k':>28s}  {'ms/step: step dense place copy read write wait bg':>56s}  prefetch/write-backs")
    for k, c in res.items():
        h, r, m = c["hit_rates"], c["rows_per_step"], c["ms_per_step"]
        p(f"{k:26s} {c['over_baseline']:6.3f} {c['warmup_steps']:4d} {h['device']:5.3f}/{h['host']:5.3f}/{h['disk']:5.3f}"
          f" {r['host_to_device']:7.0f}{r['device_to_host']:7.0f}{r['disk_to_host']:7.0f}{r['host_to_disk']:6.0f}"
          f"          {m['step']:7.1f}{m['dense']:6.1f}{m['placement']:6.1f}{m['copies']:5.1f}{m['lmdb_read']:6.1f}"
          f"{m['lmdb_write']:6.1f}{m['wait']:6.1f}{m['bg']:6.1f}  {c['prefetch_background'] or '-'}/"
          f"{'behind' if c['write_behind'] else 'in step'}")


def bound(c: dict, batch: int) -> dict:
    """The LMDB bound of configuration figures ``c`` (see the module docstring): the best
    any design that reads and writes each row crossing the disk tier once through LMDB can
    reach beside the baseline, its LMDB time added to the baseline's step (serial) or
    hidden behind it on another core (overlapped)."""
    base = 1e3 * batch / c["baseline_samples_per_s"]
    io = c["ms_per_step"]["lmdb_read"] + c["ms_per_step"]["lmdb_write"]
    return {"baseline_ms": round(base, 3), "lmdb_ms": round(io, 3), "serial": round(base / (base + io), 3),
            "overlapped": round(base / max(base, io, 1e-9), 3)}


def summary(res: dict, Ws: dict, proj: dict, png: Path, a, pairs: dict | None = None) -> dict:
    """The JSON line: headline ratios, then every configuration's figures.  The worst
    prefetch and write-behind ratios come from the paired measurements (:func:`paired`)
    where there are any; ``*_unpaired``: the same from configurations measured apart."""
    pairs = pairs or {}

    def lmdb_bound(k):
        return bound(res[k], a.batch) if k in res else None

    def worst_pair(what):
        r = [v["ratio"] for k, v in pairs.items() if k.split("/")[1].startswith(what + "@")]
        return min(r) if r else None
    wp = worst(res, (("disk_pf", "disk"), ("disk_pf_wb", "disk_wb")))
    ww = worst(res, (("disk_wb", "disk"), ("disk_pf_wb", "disk_pf")))
    r = lambda k: None if k not in res else round(res[k]["over_baseline"], 3)  # noqa: E731
    rnd = lambda x: None if x is None else round(x, 3)  # noqa: E731
    head = "zipf1.05/disk_pf@2W"
    return {"steady_host_over_baseline": r("zipf1.05/host_pf@2W"),
            "steady_disk_prefetch_over_baseline": r(head),
            "criteo_steady_disk_prefetch_over_baseline": r("criteo/disk_pf@2W"),
            "cold_disk_prefetch_over_baseline": r("zipf1.05/cold_pf@2W"),
            "device_over_baseline": r("zipf1.05/device"),
            "worst_prefetch_over_no_prefetch": rnd(worst_pair("prefetch") if pairs else wp),
            "worst_write_behind_over_sync": rnd(worst_pair("write_behind") if pairs else ww),
            "worst_prefetch_over_no_prefetch_unpaired": rnd(wp),
            "worst_write_behind_over_sync_unpaired": rnd(ww),
            "paired": {k: {"ratio": rnd(v["ratio"]), "block_ratios": v["block_ratios"],
                           "prefetch_write_behind": [v["a"], v["b"]]} for k, v in pairs.items()
                       if k.split("/")[1].split("@")[0] != "same"},
            "paired_noise": {k: {"ratio": rnd(v["ratio"]), "quartiles": [rnd(q) for q in
                                                                      np.percentile(v["block_ratios"], [25, 75])]}
                             for k, v in pairs.items() if k.split("/")[1].split("@")[0] == "same"},
            "steady_disk_prefetch_lmdb_bound": lmdb_bound(head),
            "criteo_steady_disk_prefetch_lmdb_bound": lmdb_bound("criteo/disk_pf@2W"),
            "warmup_steps": res[head]["warmup_steps"] if head in res else None,
            "warmup_steps_max": max(c["warmup_steps"] for c in res.values()),
            "warmup_capped": [k for k, c in res.items() if not c["settled"]],
            "working_set_rows": {k: round(v, 1) for k, v in Ws.items()},
            "quick": a.quick, "device": a.device, "batch": a.batch, "timed_steps": a.steps,
            "timed_steps_max": max(c["timed_steps"] for c in res.values()), "png": str(png),
            "configs": {k: {"over_baseline": round(c["over_baseline"], 3),
                            "over_baseline_median": round(c["over_baseline_median"], 3),
                            "timed_steps": c["timed_steps"], "commits_timed": c["commits_timed"],
                            "align_steps": c["align_steps"],
                            "write_combine": c["write_combine"],
                            "samples_per_s": round(c["samples_per_s"], 1),
                            "baseline_samples_per_s": round(c["baseline_samples_per_s"], 1),
                            "warmup_steps": c["warmup_steps"], "hit_rates": c["hit_rates"],
                            "rows_per_step": c["rows_per_step"], "ms_per_step": c["ms_per_step"],
                            "prefetch": c["prefetch_background"], "write_behind": c["write_behind"]}
                        for k, c in res.items()},
            "projection_gpu_host": proj,
            "policies": policy_summary(res)}


def policy_summary(res: dict) -> dict | None:
    """The ``disk_pf@2W[policy]`` runs (same run, same batches): LMDB rows per step (read
    + written) and samples/s of each, and the best (fewest LMDB rows) against lru."""
    runs = {k.split("[")[1].rstrip("]"): c for k, c in res.items() if "/disk_pf@2W[" in k}
    if not runs:
        return None
    rows = {p: c["rows_per_step"]["disk_to_host"] + c["rows_per_step"]["host_to_disk"] for p, c in runs.items()}
    out = {"workload": next(k for k in res if "/disk_pf@2W[" in k).split("/")[0],
           "lmdb_rows_per_step": {p: round(v, 1) for p, v in rows.items()},
           "samples_per_s": {p: round(c["samples_per_s"], 1) for p, c in runs.items()},
           "over_baseline": {p: round(c["over_baseline"], 3) for p, c in runs.items()},
           "device_hit_rate": {p: c["hit_rates"]["device"] for p, c in runs.items()}}
    best = min(rows, key=rows.get)
    out["best"] = best
    if "lru" in runs:
        out["best_lmdb_rows_over_lru"] = round(rows[best] / max(rows["lru"], 1e-9), 3)
        out["best_throughput_over_lru"] = round(runs[best]["samples_per_s"] / runs["lru"]["samples_per_s"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="zipf1.05 + criteo, sizes 1 2 W (< 90 s)")
    ap.add_argument("--rows", type=int, default=None, help="rows per Zipf table (default 500k, quick 120k)")
    ap.add_argument("--criteo-rows", type=int, default=None, help="Criteo rows in all (default 4M, quick 400k)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=None, help="samples per batch (default 512, quick 256)")
    ap.add_argument("--pooling", type=int, default=4, help="ids per bag, Zipf workloads")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per configuration (>= 30)")
    ap.add_argument("--warmup-cap", type=int, default=None, help="most warm-up steps (default 300, quick 100)")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="device tier in multiples of W")
    ap.add_argument("--write-behind-sizes", type=int, nargs="*", default=None,
                    help="sizes also run with write-behind (default: all; quick: 2)")
    ap.add_argument("--workloads", nargs="+", default=None, choices=("zipf1.05", "zipf1.2", "criteo"),
                    help="default: all three (quick: zipf1.05 criteo)")
    ap.add_argument("--png", type=Path, default=None, help="default runs/bench_train.png")
    ap.add_argument("--policies", default=None,
                    help="eviction policies run on the first workload's disk_pf@2W, comma-separated (default: "
                         "lru,s3fifo,arc,wtinylfu; quick: lru,s3fifo,wtinylfu; 'none' to skip)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the model, the baseline's tables and the device tier live (default cpu)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    if a.steps < 30:
        ap.error("--steps must be >= 30")
    a.rows = a.rows or (120_000 if a.quick else 500_000)
    a.criteo_rows = a.criteo_rows or (400_000 if a.quick else 4_000_000)
    a.batch = a.batch or (256 if a.quick else 512)
    a.warmup_cap = a.warmup_cap or (100 if a.quick else 300)
    sizes = a.sizes or ([1, 2] if a.quick else [1, 2, 4, 8])
    pol = a.policies or ("lru,s3fifo,wtinylfu" if a.quick else "lru,s3fifo,arc,wtinylfu")
    a.policies = [] if pol == "none" else [p.strip() for p in pol.split(",") if p.strip()]
    wb_sizes = a.write_behind_sizes if a.write_behind_sizes is not None else ([2] if a.quick else sizes)
    png = a.png or Path(__file__).resolve().parent.parent / "runs" / "bench_train.png"
    torch.manual_seed(0)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    names = a.workloads or (["zipf1.05", "criteo"] if a.quick else ["zipf1.05", "zipf1.2", "criteo"])
    make = {"zipf1.05": lambda: zipf_workload(1.05, a.rows, a.dim, a.pooling),
            "zipf1.2": lambda: zipf_workload(1.2, a.rows, a.dim, a.pooling, seed=100),
            "criteo": lambda: criteo_workload(a.criteo_rows, a.dim, seed=200)}
    wls = [make[n]() for n in names]
    real = real_criteo_share()
    alphas = [z.alpha for w in wls if w.name == "criteo" for z in w.samplers] or [0.0]
    print(f"criteo skew: top 1% of each table's rows take 90% of its accesses (Zipf exponents "
          f"{min(alphas):.2f}..{max(alphas):.2f}); real head "
          + (f"(criteo-dac-head8k, 7,200 rows): top 1% of ids take {real:.0%}" if real is not None else "absent"),
          file=sys.stderr)
    res, Ws, pairs = {}, {}, {}
    for wl in wls:
        a.cold = wl is wls[0] or not a.quick  # quick: cold start and write-behind on the first only
        out, Ws[wl.name], pr = run_workload(a, wl, sizes, wb_sizes if a.cold else [])
        res.update(out)
        pairs.update(pr)
    print_table(res)
    proj = projection(res, a.dim * 4)
    print("\nPROJECTION (not measured): step time a GPU host (HBM 4.8 TB/s, PCIe Gen5 x16 55 GB/s, NVMe 7 GB/s) "
          f"needs for prefetch to hide the disk tier, with this machine's LMDB cost per row "
          f"({proj['lmdb_read_us_per_row_here']} us read, {proj['lmdb_write_us_per_row_here']} us write):",
          file=sys.stderr)
    for k, v in proj.items():
        if isinstance(v, dict):
            print(f"  {k:26s} hides LMDB at steps >= {v['hide_disk_at_step_ms']:7.2f} ms "
                  f"(all transfers: {v['hide_all_io_at_step_ms']:.2f} ms)", file=sys.stderr)
    for k, c in res.items():
        if k.endswith("/disk_pf@2W"):
            b = bound(c, a.batch)
            print(f"  LMDB bound {k:22s} baseline {b['baseline_ms']:.2f} ms/step, LMDB {b['lmdb_ms']:.2f} ms/step: "
                  f"at most x{b['serial']:.3f} serial, x{b['overlapped']:.3f} overlapped", file=sys.stderr)
    load = (round(load0, 2), round(os.getloadavg()[0], 2))
    gpu = f" + {torch.cuda.get_device_name()}" if a.device == "cuda" else " (no GPU)"
    plot(res, [w.name for w in wls], sizes, png, f"measured on {os.cpu_count()} CPU cores{gpu}, batch {a.batch}, "
         f"{a.steps} timed steps in blocks interleaved with the baseline; load average {load[0]} -> {load[1]}")
    print(f"\nPNG: {png}; {time.perf_counter() - t0:.0f} s; load average {load[0]} at the start, {load[1]} at the end"
          f" on {os.cpu_count()} cores" + ("  (SHARED MACHINE: other work competed for the cores, ratios are noisy)"
                                          if load0 > 0.5 * (os.cpu_count() or 1) else ""), file=sys.stderr)
    out = summary(res, Ws, proj, png, a, pairs)
    out.update(seconds=round(time.perf_counter() - t0, 1), load_average=load, cpus=os.cpu_count())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
