"""Load test: one process trains and flushes while read-only processes read the same store.

Phases, each on a fresh store, each ``--seconds`` long after every process is ready:

* ``alone``: the writer trains (lookup + update of a batch of distinct rows of each of
  two tables, Adagrad; a flush every ``--flush-every`` steps; tiers far smaller than the
  tables, so rows are evicted and written back all the time) with no reader: the
  baseline of writer steps/s;
* ``readers``: the same writer with ``--readers`` read-only processes
  (``HierarchicalStore.open(path, readonly=True)``) each looking up random batches as
  fast as it can;
* ``readers-nice`` (unless ``--quick``): the same with the readers at ``nice 19``, which
  tells lost CPU (readers and writer sharing too few cores) from blocking (readers
  holding the writer up): readers that blocked the writer would slow it niced or not.

Exactness: the writer keeps a flat reference of every record (weights and optimizer
state, bitwise equal to the store's), checks every lookup against it, and logs a 64-bit
hash of every record it ever holds, with its step, and the step of every flush.  Every
reader keeps, for every row of every lookup, the hash of the record it read and the
flush number its snapshot reported.  Afterwards each observation must be a record the
writer held (else **torn**: weights of one step with optimizer state of another, or any
other value the writer never held) and no older than the row's value at the flush the
reader reported (else **stale**).  Observations newer than that flush (rows evicted and
written back since) are counted as ``later``.

    python scripts/bench_readers.py                 # 3 phases x 10 s, 4 readers
    python scripts/bench_readers.py --quick         # 2 phases x 3 s, 2 readers (the test's)

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from anywhere, test this checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

TABLES = (("big", 50_000, 32), ("small", 20_000, 8))  # name, rows, dim
DEVICE_ROWS, HOST_ROWS = 2048, 8192
BATCH = 512  # distinct rows per table per step
READ_BATCH = 1024
WARMUP_STEPS = 3  # writer steps (and reader lookups) before the timed part
SEED = 5
_MULT = np.random.default_rng(12345).integers(1, 2**63, size=64, dtype=np.uint64) | np.uint64(1)


def key_of(ti: int, ids: np.ndarray) -> np.ndarray:
    return (np.uint64(ti) << np.uint64(20)) | ids.astype(np.uint64)


def rec_hash(rec: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each record's bits (rows of float32 ``[n, w]``, w <= 64)."""
    u = np.ascontiguousarray(rec, dtype=np.float32).view(np.uint32).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = (u * _MULT[:u.shape[1]]).sum(1, dtype=np.uint64)
        return h ^ (h >> np.uint64(29))


def specs():
    import hiermem as hm
    return [hm.TableSpec(n, r, d) for n, r, d in TABLES]


def _wait_go() -> None:
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        sys.exit(0)


# -- the writer -----------------------------------------------------------------------
def writer(a: argparse.Namespace) -> int:
    import torch

    import hiermem as hm
    from hiermem.store.rows import initial_records

    torch.set_num_threads(1)
    opt = hm.Adagrad(lr=0.05)
    tables = specs()
    store = hm.HierarchicalStore(tables, hm.StoreConfig(path=a.store, device_rows=DEVICE_ROWS, host_rows=HOST_ROWS,
                                                        optimizer=opt, seed=SEED))
    store.flush()  # flush 1: the initial state (nothing written yet)
    refs = [initial_records(s, i, SEED, opt, torch.arange(s.num_rows)) for i, s in enumerate(tables)]
    steps_per_table = [0] * len(tables)
    g = torch.Generator().manual_seed(a.seed)
    logs, flushes = [], {store._flush_seq: 0}
    state = {"step": 0, "mismatches": 0}

    def one_step() -> None:
        state["step"] += 1
        step = state["step"]
        for ti, s in enumerate(tables):
            ids = torch.randperm(s.num_rows, generator=g)[:BATCH]
            emb = store.lookup(s.name, ids)
            ref = refs[ti]
            if not torch.equal(emb, ref.index_select(0, ids)[:, :s.dim]):
                state["mismatches"] += 1
            grads = 0.5 * emb + torch.randn(emb.shape, generator=g)
            store.update(s.name, ids, grads)
            steps_per_table[ti] += 1
            rec = ref.index_select(0, ids)
            opt.apply(rec, grads, s.dim, steps_per_table[ti])
            ref.index_copy_(0, ids, rec)
            logs.append((key_of(ti, ids.numpy()), rec_hash(rec.numpy()), np.full(BATCH, step, dtype=np.int64)))
        if step % a.flush_every == 0:
            store.flush()
            flushes[store._flush_seq] = step

    for _ in range(WARMUP_STEPS):  # first calls (kernels, allocations) outside the timing
        one_step()
    _wait_go()
    t0, first = time.perf_counter(), state["step"]
    while time.perf_counter() - t0 < a.seconds:
        one_step()
    step, mismatches = state["step"] - first, state["mismatches"]
    seconds = time.perf_counter() - t0
    store.close()
    keys, hashes, st = (np.concatenate([x[i] for x in logs]) if logs else np.zeros(0, np.uint64) for i in range(3))
    init = [(key_of(ti, np.arange(s.num_rows)), rec_hash(initial_records(s, ti, SEED, opt,
                                                                         torch.arange(s.num_rows)).numpy()))
            for ti, s in enumerate(tables)]
    seqs = np.array(sorted(flushes), dtype=np.int64)
    np.savez(a.out, keys=keys, hashes=hashes, steps=st, init_keys=np.concatenate([k for k, _ in init]),
             init_hashes=np.concatenate([h for _, h in init]), flush_seqs=seqs,
             flush_steps=np.array([flushes[int(q)] for q in seqs], dtype=np.int64))
    print(json.dumps({"steps": step, "seconds": seconds, "mismatches": mismatches}), flush=True)
    return 0


# -- a reader -------------------------------------------------------------------------
def reader(a: argparse.Namespace) -> int:
    import torch

    import hiermem as hm

    torch.set_num_threads(1)
    while not (Path(a.store) / "data.mdb").exists():
        time.sleep(0.05)
    r = hm.HierarchicalStore.open(a.store, readonly=True)
    rng = np.random.default_rng(a.seed)
    obs = []

    def one_lookup() -> None:
        ti = int(rng.integers(len(TABLES)))
        ids = rng.integers(0, TABLES[ti][1], READ_BATCH)
        rec = r.records(TABLES[ti][0], torch.from_numpy(ids)).numpy()
        obs.append((key_of(ti, ids), rec_hash(rec), np.full(READ_BATCH, r.flush_seq, dtype=np.int64)))

    for _ in range(WARMUP_STEPS):
        one_lookup()
    _wait_go()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.seconds:
        one_lookup()
        n += 1
    seconds = time.perf_counter() - t0
    r.close()
    keys, hashes, seqs = (np.concatenate([x[i] for x in obs]) for i in range(3))
    np.savez(a.out, keys=keys, hashes=hashes, seqs=seqs)
    print(json.dumps({"lookups": n, "rows": int(keys.size), "seconds": seconds}), flush=True)
    return 0


# -- the check ------------------------------------------------------------------------
def check(wlog: Path, rlogs: list[Path]) -> dict:
    """Every reader observation against the writer's log (see the module docstring)."""
    w = np.load(wlog, allow_pickle=False)
    keys = np.concatenate([w["keys"], w["init_keys"]])
    hashes = np.concatenate([w["hashes"], w["init_hashes"]])
    steps = np.concatenate([w["steps"], np.zeros(w["init_keys"].size, dtype=np.int64)])
    with np.errstate(over="ignore"):
        mix = keys * np.uint64(0x9E3779B97F4A7C15) ^ hashes
    order = np.argsort(mix, kind="stable")
    mix_s, step_s = mix[order], steps[order]
    upd = np.sort((w["keys"] << np.uint64(32)) | w["steps"].astype(np.uint64))  # (row, step) of every update
    fseq, fstep = w["flush_seqs"], w["flush_steps"]
    out = {"observations": 0, "torn": 0, "stale": 0, "later": 0, "unknown_seq": 0}
    for p in rlogs:
        r = np.load(p, allow_pickle=False)
        # the distinct (row, record, flush) triples a reader saw
        trip = np.unique(np.stack([r["keys"], r["hashes"], r["seqs"].astype(np.uint64)], 1), axis=0)
        k, h, q = trip[:, 0], trip[:, 1], trip[:, 2].astype(np.int64)
        out["observations"] += int(r["keys"].size)
        with np.errstate(over="ignore"):
            m = k * np.uint64(0x9E3779B97F4A7C15) ^ h
        j = np.minimum(np.searchsorted(mix_s, m), mix_s.size - 1)
        held = mix_s[j] == m
        out["torn"] += int((~held).sum())
        seen_step = np.where(held, step_s[j], -1)
        qi = np.searchsorted(fseq, q)
        known = (qi < fseq.size) & (fseq[np.minimum(qi, fseq.size - 1)] == q)
        out["unknown_seq"] += int((~known).sum())
        at = fstep[np.minimum(qi, fseq.size - 1)]
        # the row's last update at or before that flush (0: never, its initial value)
        u = np.searchsorted(upd, (k << np.uint64(32)) | at.astype(np.uint64), side="right") - 1
        ok_u = (u >= 0) & ((upd[np.maximum(u, 0)] >> np.uint64(32)) == k)
        last = np.where(ok_u, (upd[np.maximum(u, 0)] & np.uint64(0xFFFFFFFF)).astype(np.int64), 0)
        out["stale"] += int((held & known & (seen_step < last)).sum())
        out["later"] += int((held & known & (seen_step > at)).sum())
    out["distinct_checked"] = None  # filled below
    return out


# -- the harness ----------------------------------------------------------------------
def _spawn(role: str, work: Path, store: Path, out: Path, seconds: float, seed: int, nice: int = 0,
           flush_every: int = 10) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--store", str(store), "--out", str(out),
           "--seconds", str(seconds), "--seed", str(seed), "--flush-every", str(flush_every)]
    if nice:
        cmd = ["nice", "-n", str(nice)] + cmd
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(work / f"{out.stem}.err", "w"),
                            text=True, bufsize=1)


def _ready(p: subprocess.Popen, what: str) -> None:
    line = p.stdout.readline().strip()
    if line != "READY":
        raise RuntimeError(f"{what} did not start: {line!r}")


def phase(work: Path, name: str, seconds: float, readers: int, nice: int, flush_every: int) -> dict:
    d = work / name
    d.mkdir()
    store = d / "store"
    w = _spawn("writer", d, store, d / "writer.npz", seconds, 1, flush_every=flush_every)
    _ready(w, "the writer")
    rs = [_spawn("reader", d, store, d / f"reader{i}.npz", seconds, 100 + i, nice) for i in range(readers)]
    for i, r in enumerate(rs):
        _ready(r, f"reader {i}")
    for p in [w] + rs:
        p.stdin.write("GO\n")
        p.stdin.flush()
    res = []
    for p in [w] + rs:
        out = p.stdout.read().strip().splitlines()
        if p.wait() != 0 or not out:
            raise RuntimeError(f"{name}: a process failed ({p.args[-12:]}); see {d}")
        res.append(json.loads(out[-1]))
    wr = res[0]
    row = {"phase": name, "readers": readers, "nice": nice, "writer_steps": wr["steps"],
           "writer_steps_per_s": wr["steps"] / wr["seconds"], "writer_mismatches": wr["mismatches"],
           "reader_lookups_per_s": [r["lookups"] / r["seconds"] for r in res[1:]]}
    row["reader_lookups_per_s_total"] = sum(row["reader_lookups_per_s"])
    if readers:
        row.update(check(d / "writer.npz", [d / f"reader{i}.npz" for i in range(readers)]))
        row.pop("distinct_checked")
    return row


def main(argv: list[str] | None = None) -> int:
    # readers and writer check rows bit for bit against a torch-op reference: the torch
    # data plane (the compiled one equals it to ~1 ulp; see docs/dataplane.md).  Set here,
    # not at import: a test importing this module keeps its own environment
    os.environ.setdefault("HIERMEM_DATA_PLANE", "torch")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--flush-every", type=int, default=25,
                   help="writer steps between flushes (more than the tiers hold: dirty rows are evicted between)")
    p.add_argument("--quick", action="store_true", help="2 phases x 3 s with 2 readers")
    p.add_argument("--dir", default=None)
    p.add_argument("--role", choices=("writer", "reader"), help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role == "writer":
        return writer(a)
    if a.role == "reader":
        return reader(a)
    if a.quick:
        a.seconds, a.readers = min(a.seconds, 3.0), min(a.readers, 2)
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="hm-readers-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = [phase(work, "alone", a.seconds, 0, 0, a.flush_every),
                phase(work, "readers", a.seconds, a.readers, 0, a.flush_every)]
        if not a.quick:
            rows.append(phase(work, "readers-nice", a.seconds, a.readers, 19, a.flush_every))
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    base = rows[0]["writer_steps_per_s"]
    for r in rows:
        r["writer_ratio"] = r["writer_steps_per_s"] / base
        print(f"{r['phase']:13s} readers={r['readers']} writer {r['writer_steps_per_s']:7.2f} steps/s "
              f"({r['writer_ratio']:.2f}x alone)  readers {r['reader_lookups_per_s_total']:8.1f} lookups/s"
              + (f"  checked={r['observations']} torn={r['torn']} stale={r['stale']} later={r['later']}"
                 if r["readers"] else ""), flush=True)
    bad = sum(r.get("torn", 0) + r.get("stale", 0) + r.get("unknown_seq", 0) + r["writer_mismatches"] for r in rows)
    print(json.dumps({"cpus": os.cpu_count(), "seconds": a.seconds, "readers": a.readers, "batch": BATCH,
                      "read_batch": READ_BATCH, "phases": rows, "ok": bad == 0}))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
