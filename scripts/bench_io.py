"""Does background LMDB I/O overlap the training thread?  In-thread vs the I/O process.

py-lmdb holds the GIL through getmulti, putmulti and commit, so a read-ahead or
write-behind thread doing LMDB work itself stops the training thread's Python for as
long as LMDB works.  With ``StoreConfig(io_process=True)`` (the default on Linux) the
background threads hand that work to a child process and wait on a pipe instead.

One run, three phases of the same length: the foreground (a training-thread stand-in:
Python and small numpy ops, single-threaded) alone; then beside a background thread
doing a training step's read-ahead and write-behind commit of a disk tier ``--rate``
times a second, itself; then the same background through the disk tier's I/O processes.  Prints foreground and background
rates; the last line is a JSON object with the ratios (``fg_*_over_alone``: 1.0 means
the background cost the foreground nothing).  Needs two free cores to show the
process's gain: on fewer, the processes share the foreground's core.

Then the LMDB cost per row: microseconds per row of the store's batched read (one
``DiskTier.read`` per table, as the store reads a step's missing rows) and write (one
``DiskTier.write`` of every table's rows with the store's metadata, as an eviction
write-back) of one step's rows (``--step-rows`` distinct rows over 8 tables whose
records are 36, 68, 132 and 272 bytes, as row-wise Adagrad tables of dim 8 to 64 hold
them; bench_train moves ~1.7-2.2k rows a step each way), against a raw py-lmdb loop
over the same keys in the same run (per table a sorted ``getmulti`` and one buffer of
values; ``putmulti`` in one transaction of prepared keys and values), in alternating
order; medians (and minima) of ``--reps`` steps, ratios the median of the steps'
ratios.  ``*_store_over_raw`` is the store's overhead (target <= 1.3);
``convert_us_per_row`` is the part of it that makes py-lmdb's key and value objects
from the id and record arrays (the raw loop gets them made).  The same
raw loop over the same rows in an environment of format version 1 (one ``rows``
database, 12-byte big-endian keys compared as bytes), beside it in the same run, is the
before of the format change: ``*_raw_v2_over_v1``.  Store, raw loop and version-1 raw
loop each have an environment of their own with the same rows, opened as the store opens
its own (flags, preallocated ``writemap`` map).

The same step's rows read and committed through the disk tier's I/O process, request to
reply, by its C build (``hiermem/tiers/lmdb_server.c``) and its Python one, on the
store's environment: ``read_proc_c_over_py``, ``write_proc_c_over_py``.

    python scripts/bench_io.py [--quick] [--per-row-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import lmdb

from hiermem.tiers.disk import DiskTier, key_list, value_list
from hiermem.tiers import lmdb_process, native
from hiermem.tiers.records import encode_keys_v1

W = 16
TABLES = 8
WIDTHS = [9, 17, 33, 68]  # floats per record, table t: WIDTHS[t % len(WIDTHS)] (dim 8..64 + row-wise state)


def foreground(seconds: float) -> float:
    """Work units per second of a GIL-bound stand-in for the training thread."""
    rng = np.random.default_rng(0)
    a = rng.random(2048)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x = 0
        for i in range(2000):
            x += i
        np.argsort(a)
        n += 1
    return n / (time.perf_counter() - t0)


def background(disk: DiskTier, rows: int, reads: int, writes: int, rate: float, stop: threading.Event,
               out: list) -> None:
    """Read-ahead ``reads`` and write-behind ``writes`` random rows per round, ``rate``
    rounds a second at most (a training step's worth each), until stopped."""
    rng = np.random.default_rng(1)
    n = 0
    t0 = time.perf_counter()
    while not stop.is_set():
        ahead = t0 + n / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)
        ids = np.unique(rng.integers(0, rows, reads))
        disk.read_ahead([(0, ids, W)], disk.begin_read_ahead(), keep=2)
        wids = np.unique(rng.integers(0, rows, writes))
        disk.enqueue([(0, wids, np.full((len(wids), W), n, dtype=np.float32))])
        n += 1
    disk.drain()
    out.append(n / (time.perf_counter() - t0))


def phase(path: Path, io: bool, rows: int, reads: int, writes: int, rate: float, seconds: float) -> tuple[float, float]:
    disk = DiskTier(path, create=False, sync=False, write_behind=True, io_process=io)
    try:
        stop, out = threading.Event(), []
        th = threading.Thread(target=background, args=(disk, rows, reads, writes, rate, stop, out), name="bg")
        th.start()
        time.sleep(0.3)  # the I/O processes are up
        fg = foreground(seconds)
        stop.set()
        th.join()
        if io:
            assert disk.io_process and disk.io_failures == 0, "the I/O processes failed"
        return fg, out[0]
    finally:
        disk.close()


def raw_read(env, dbs: list, keys: list[list[bytes]]) -> list[np.ndarray]:
    """Raw py-lmdb: per table one sorted ``getmulti`` and the values as one float32 array."""
    with env.begin(buffers=False) as txn:
        return [np.frombuffer(b"".join([v for _, v in txn.cursor(db=db).getmulti(k)]), dtype="<f4")
                for db, k in zip(dbs, keys)]


def raw_write(tier: DiskTier, dbs: list, items: list[list[tuple[bytes, bytes]]]) -> None:
    """Raw py-lmdb: one transaction, per table one ``putmulti`` of prepared (key, value)
    pairs (through the tier's transaction wrapper only so that a full map grows as for the
    store)."""
    tier._write_txn(lambda txn: [txn.cursor(db=db).putmulti(it) for db, it in zip(dbs, items)])


def step_rows(rng, rows: int, n: int) -> list[tuple[int, np.ndarray]]:
    """One step's distinct rows: ``(table, sorted ids)`` for each of ``TABLES`` tables."""
    per = rows // TABLES
    return [(t, np.unique(rng.integers(0, per, n // TABLES))) for t in range(TABLES)]


def raw_tier(path: Path, version: int) -> tuple[DiskTier, list]:
    """An environment opened as the store opens its own (same flags, same preallocated
    map; its ``env`` used raw), in format ``version``: its databases, one per table
    (version 2) or ``rows`` for every table (version 1)."""
    if version == 1:  # the layout version 1 made; the tier opens it for its metadata only
        env = lmdb.open(str(path), map_size=1 << 20, max_dbs=4)
        env.open_db(b"rows")
        env.open_db(b"meta")
        env.close()
        tier = DiskTier(path, create=False, sync=False, writemap=None)
        return tier, [tier.rows_db] * TABLES
    tier = DiskTier(path, create=True, sync=False, writemap=None, tables=TABLES)
    return tier, [tier.table_database(t) for t in range(TABLES)]


def _fill(d: DiskTier, raws: dict, per: int) -> None:
    """Every row of every table (zeros) in the store's environment and the raw ones."""
    for t in range(TABLES):
        w = WIDTHS[t % len(WIDTHS)]
        for i in range(0, per, 100_000):
            ids = np.arange(i, min(per, i + 100_000))
            zeros = np.zeros((len(ids), w), dtype=np.float32)
            d.write([(t, ids, zeros)])
            for v, (tier, dbs) in raws.items():
                keys = (key_list(ids) if v == 2
                        else encode_keys_v1(np.full(len(ids), t, np.uint32), ids).view("V12").tolist())
                tier._write_txn(lambda txn: txn.cursor(db=dbs[t]).putmulti(zip(keys, value_list(zeros)), append=True))


def per_row_costs(path: Path, rows: int, n: int, reps: int) -> dict:
    """us per row of the store's batched read and write of a step's rows vs raw py-lmdb,
    in this format and (raw) in version 1's.  Three environments with the same rows and
    flags (the store's, the raw loop's, the version-1 raw loop's), each read and written
    once a step, so each one's pages age alike."""
    d = DiskTier(path / "store", create=True, sync=False, writemap=None, tables=TABLES)  # the store's defaults
    raws = {2: raw_tier(path / "raw", 2), 1: raw_tier(path / "raw-v1", 1)}
    procs = {}
    try:
        per = rows // TABLES
        _fill(d, raws, per)
        # the disk tier's I/O processes on the store's environment: the C one (where it
        # builds) and the Python one, each reading and committing the step's rows itself
        for name, server in (("c", "native"), ("py", "python")):
            os.environ[native.ENV] = server
            try:
                procs[name] = lmdb_process.LmdbProcess(path / "store", d.map_size, write=True, sync=False,
                                                       writemap=d.writemap, max_dbs=TABLES + 4)
            except native.NativeServerError as e:
                print(f"bench_io: no C I/O process: {e}", file=sys.stderr)
        os.environ.pop(native.ENV, None)
        meta_raw = json.dumps({"bench": True}).encode()
        (tier2, dbs2), (tier1, dbs1) = raws[2], raws[1]
        meta = {"tables": [{"name": f"t{t}", "num_rows": per, "dim": WIDTHS[t % len(WIDTHS)]} for t in range(TABLES)],
                "seed": 0}
        rng = np.random.default_rng(2)
        names = ("read_store", "read_raw", "read_raw_v1", "write_store", "write_raw", "write_raw_v1", "convert")
        names += tuple(f"{op}_proc_{p}" for p in procs for op in ("read", "write"))
        times = {k: [] for k in names}
        for r in range(-2, reps):  # two untimed rounds first (pages, the map's size)
            groups = step_rows(rng, rows, n)
            m = sum(len(ids) for _, ids in groups)
            recs = [(t, ids, rng.random((len(ids), WIDTHS[t % len(WIDTHS)]), dtype=np.float32)) for t, ids in groups]
            keys = [key_list(ids) for _, ids in groups]
            items = [list(zip(k, value_list(rec))) for k, (_, _, rec) in zip(keys, recs)]
            keys1 = [encode_keys_v1(np.full(len(ids), t, np.uint32), ids).view("V12").tolist() for t, ids in groups]
            items1 = [list(zip(k, value_list(rec))) for k, (_, _, rec) in zip(keys1, recs)]
            ops = {"read_store": lambda: [d.read(t, ids, WIDTHS[t % len(WIDTHS)]) for t, ids in groups],
                   "read_raw": lambda: raw_read(tier2.env, dbs2, keys),
                   "read_raw_v1": lambda: raw_read(tier1.env, dbs1, keys1),
                   "write_store": lambda: d.write(recs, meta=meta),
                   "write_raw": lambda: raw_write(tier2, dbs2, items),
                   "write_raw_v1": lambda: raw_write(tier1, dbs1, items1),
                   "convert": lambda: [(key_list(ids), value_list(rec)) for _, ids, rec in recs]}
            for name, p in procs.items():
                ops[f"read_proc_{name}"] = lambda p=p: p.read([(t, ids, WIDTHS[t % len(WIDTHS)]) for t, ids in groups])
                ops[f"write_proc_{name}"] = lambda p=p: p.write(recs, meta_raw)
            order = list(ops) if r % 2 else list(reversed(ops))
            for k in order:
                t0 = time.perf_counter()
                ops[k]()
                if r >= 0:
                    times[k].append((time.perf_counter() - t0) / m * 1e6)
    finally:
        for p in procs.values():
            p.close()
        d.close()
        for tier, _ in raws.values():
            tier.close()
    t = {k: np.array(v) for k, v in times.items()}

    def ratio(a: str, b: str) -> float:  # median of the steps' ratios: each pair ran side by side
        return round(float(np.median(t[a] / t[b])), 3)
    return {**{f"{k}_us_per_row": round(float(np.median(v)), 3) for k, v in t.items()},
            **{f"{k}_us_per_row_min": round(float(v.min()), 3) for k, v in t.items()},
            "read_store_over_raw": ratio("read_store", "read_raw"),
            "write_store_over_raw": ratio("write_store", "write_raw"),
            "read_raw_v2_over_v1": ratio("read_raw", "read_raw_v1"),
            "write_raw_v2_over_v1": ratio("write_raw", "write_raw_v1"),
            "read_store_over_raw_v1": ratio("read_store", "read_raw_v1"),
            "write_store_over_raw_v1": ratio("write_store", "write_raw_v1"),
            **({"read_proc_c_over_py": ratio("read_proc_c", "read_proc_py"),
                "write_proc_c_over_py": ratio("write_proc_c", "write_proc_py")} if "c" in procs else {}),
            "rows_per_step": m, "writemap": d.writemap, "reps": reps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows, shorter phases (< 30 s)")
    ap.add_argument("--rows", type=int, default=None, help="rows in LMDB (default 800k, quick 200k)")
    ap.add_argument("--reads", type=int, default=13_000, help="rows read ahead per background round")
    ap.add_argument("--writes", type=int, default=10_000, help="rows written behind per background round")
    ap.add_argument("--rate", type=float, default=4.0,
                    help="background rounds per second (a step's I/O each; in-thread sustains about 5 here)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per phase (default 8, quick 3)")
    ap.add_argument("--step-rows", type=int, default=2_000, help="ids drawn per step for the per-row costs")
    ap.add_argument("--reps", type=int, default=None, help="steps timed for the per-row costs (default 60, quick 30)")
    ap.add_argument("--per-row-only", action="store_true", help="only the per-row costs (no overlap phases)")
    ap.add_argument("--widths", type=int, nargs="+", default=None,
                    help="floats per record of the tables, cycled (default 9 17 33 68: 36-272 B)")
    a = ap.parse_args(argv)
    if not lmdb_process.supported():
        print("bench_io: I/O processes need Linux", file=sys.stderr)
        return 0
    rows = a.rows or (200_000 if a.quick else 800_000)
    if a.widths:
        WIDTHS[:] = a.widths
    per_row_rows = a.rows or (960_000 if a.quick else 4_000_000)  # bench_train --quick: 8 x 120k
    seconds = a.seconds or (3.0 if a.quick else 8.0)
    tmp = Path(tempfile.mkdtemp(prefix="hiermem-bench-io-"))
    out = {}
    try:
        if not a.per_row_only:
            path = tmp / "lmdb"
            d = DiskTier(path, create=True, sync=False)
            for i in range(0, rows, 100_000):
                ids = np.arange(i, min(rows, i + 100_000))
                d.write([(0, ids, np.zeros((len(ids), W), dtype=np.float32))])
            d.close()
            alone = foreground(seconds)
            fg_t, bg_t = phase(path, False, rows, a.reads, a.writes, a.rate, seconds)
            fg_p, bg_p = phase(path, True, rows, a.reads, a.writes, a.rate, seconds)
            print(f"bench_io: {rows} rows x {W} floats; per background round {a.reads} reads + {a.writes} writes, "
                  f"at most {a.rate:g} rounds/s", file=sys.stderr)
            print(f"  foreground alone        {alone:9.0f} units/s", file=sys.stderr)
            print(f"  beside in-thread I/O    {fg_t:9.0f} units/s  x{fg_t / alone:.2f}   "
                  f"background {bg_t:6.1f} rounds/s", file=sys.stderr)
            print(f"  beside the I/O process  {fg_p:9.0f} units/s  x{fg_p / alone:.2f}   "
                  f"background {bg_p:6.1f} rounds/s", file=sys.stderr)
            out = {"fg_in_thread_over_alone": round(fg_t / alone, 3),
                   "fg_io_process_over_alone": round(fg_p / alone, 3),
                   "bg_io_process_over_in_thread": round(bg_p / bg_t, 3), "rate": a.rate, "rows": rows}
        load = os.getloadavg()[0]
        cost = per_row_costs(tmp / "per-row", per_row_rows, a.step_rows, a.reps or (30 if a.quick else 60))
        load = max(load, os.getloadavg()[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"LMDB per row, one step's {cost['rows_per_step']} rows over {TABLES} tables of {per_row_rows} rows, records "
          f"{'/'.join(str(4 * w) for w in WIDTHS)} B, writemap {cost['writemap']} (median us/row of {cost['reps']}; "
          f"load average {load:.2f}):", file=sys.stderr)
    for op in ("read", "write"):
        c = {k[len(op) + 1:]: v for k, v in cost.items() if k.startswith(op + "_")}
        print(f"  {op:5s}  store {c['store_us_per_row']:6.3f}   raw py-lmdb {c['raw_us_per_row']:6.3f}"
              f"   store/raw x{c['store_over_raw']:.2f}   raw in format 1 {c['raw_v1_us_per_row']:6.3f}"
              f"   raw now/format 1 x{c['raw_v2_over_v1']:.2f}", file=sys.stderr)
    print(f"  the store's key and value objects (py-lmdb's input): {cost['convert_us_per_row']:.3f} us/row",
          file=sys.stderr)
    for op in ("read", "write"):
        if f"{op}_proc_c_us_per_row" in cost:
            print(f"  {op:5s}  through the I/O process (request to reply): C {cost[f'{op}_proc_c_us_per_row']:6.3f}"
                  f"   Python {cost[f'{op}_proc_py_us_per_row']:6.3f}   C/Python x{cost[f'{op}_proc_c_over_py']:.2f}",
                  file=sys.stderr)
    print(json.dumps({**out, **cost, "per_row_rows": per_row_rows, "load_avg": round(load, 2), "quick": a.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
