"""LMDB's own cost per row against py-lmdb's, on the same environment and the same steps.

    python scripts/bench_lmdb_native.py [--quick] [--tables 8] [--rows 120000] [--bytes 64]
                                        [--step-rows 1700] [--steps N] [--rounds 2]

The disk tier's cost per row (``bench_io``: the store within ~1.1x of a raw py-lmdb loop)
bounds ``bench_train``'s disk configurations.  This asks how much of it is LMDB itself:
``scripts/lmdb_native.c``, a C loop over LMDB's API (built here with the system's ``cc``
and ``liblmdb-dev``: ``apt-get install liblmdb-dev``; without them the script says so and
exits 0), runs each step's reads (one read transaction, ``mdb_get`` and a copy of each
value) and writes (one write transaction, ``mdb_put`` per row, commit) over
``--tables`` integer-key sub-databases of ``--rows`` ids each, opened as the store opens
its own (no sync per commit, write map, no read-ahead).  The same steps then run through
py-lmdb on the same environment: per table a sorted ``getmulti`` into one buffer, and
``putmulti`` of prepared keys and values in one write transaction (``bench_io``'s raw
loop).  The two alternate ``--rounds`` times; figures are medians over the steps.
Defaults follow ``bench_train --quick``'s Zipf tables: 8 x 120k rows of 64-byte records
(dim 16, SGD), ~1.7k rows read and written a step at 2 x W.

Last line: JSON with ``native_read_us_per_row``, ``native_write_us_per_row``,
``py_read_us_per_row``, ``py_write_us_per_row`` and ``py_over_native_read`` /
``py_over_native_write`` (or ``skipped`` with the reason).
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

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.tiers.records import key_list  # noqa: E402  (the store's key encoding)

SRC = Path(__file__).resolve().parent / "lmdb_native.c"


def build(tmp: Path) -> tuple[Path | None, str]:
    """The C loop compiled into ``tmp``, or None and why not."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc)"
    exe = tmp / "lmdb_native"
    r = subprocess.run([cc, "-O2", "-o", str(exe), str(SRC), "-llmdb"], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"cannot build {SRC.name} (liblmdb-dev installed?): {r.stderr.strip().splitlines()[-1:]}"
    return exe, ""


def draw_steps(rng, tables: int, rows: int, step_rows: int, steps: int) -> list[list[tuple[int, np.ndarray]]]:
    """Per step, distinct random ids of each table, sorted: ``[(table, ids), ...]``."""
    out = []
    for _ in range(steps):
        per = np.bincount(rng.integers(0, tables, step_rows), minlength=tables)
        out.append([(t, np.sort(rng.choice(rows, int(per[t]), replace=False)).astype(np.int64))
                    for t in range(tables) if per[t]])
    return out


def write_ids(path: Path, steps: list) -> None:
    with open(path, "wb") as f:
        f.write(np.int64(len(steps)).tobytes())
        for step in steps:
            f.write(np.int64(sum(len(ids) for _, ids in step)).tobytes())
            for t, ids in step:
                f.write(np.stack([np.full(len(ids), t, dtype=np.int64), ids], 1).astype("<i8").tobytes())


def native(exe: Path, env_dir: Path, tables: int, nbytes: int, ids: Path, out: Path) -> np.ndarray:
    """Per-step (read, write) seconds of the C loop."""
    subprocess.run([str(exe), "steps", str(env_dir), str(tables), str(nbytes), str(ids), str(out)], check=True)
    return np.fromfile(out, dtype=np.float64).reshape(-1, 2)


def py_lmdb(env_dir: Path, tables: int, nbytes: int, steps: list) -> np.ndarray:
    """Per-step (read, write) seconds of py-lmdb's raw loop over the same steps."""
    env = lmdb.open(str(env_dir), map_size=16 << 30, max_dbs=tables + 1, sync=False, writemap=True,
                    readahead=False, meminit=False)
    try:
        dbs = [env.open_db(f"t{t}".encode(), integerkey=True, create=False) for t in range(tables)]
        out = []
        for step in steps:
            keys = [(t, key_list(ids)) for t, ids in step]  # made before the clock, as bench_io's raw loop
            t0 = time.perf_counter()
            vals = []
            with env.begin(buffers=False) as txn:
                for t, ks in keys:
                    vals.append(b"".join(v for _, v in txn.cursor(db=dbs[t]).getmulti(ks)))
            t1 = time.perf_counter()
            items = [(t, list(zip(ks, (v[i * nbytes:(i + 1) * nbytes] for i in range(len(ks))))))
                     for (t, ks), v in zip(keys, vals)]
            t2 = time.perf_counter()
            with env.begin(write=True) as txn:
                for t, it in items:
                    txn.cursor(db=dbs[t]).putmulti(it)
            t3 = time.perf_counter()
            out.append((t1 - t0, t3 - t2))
        return np.array(out)
    finally:
        env.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (< 30 s)")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=120_000, help="ids per table")
    ap.add_argument("--bytes", type=int, default=64, help="bytes per record")
    ap.add_argument("--step-rows", type=int, default=1_700, help="rows read and written per step")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default 60, quick 30)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the C and py-lmdb loops")
    a = ap.parse_args(argv)
    if not 1 <= a.tables <= 255:
        ap.error("--tables must be 1..255")
    tmp = Path(tempfile.mkdtemp(prefix="hiermem-lmdb-native-"))
    try:
        exe, why = build(tmp)
        if exe is None:
            print(f"bench_lmdb_native: skipped: {why}", file=sys.stderr)
            print(json.dumps({"skipped": why}))
            return 0
        env_dir = tmp / "env"
        env_dir.mkdir()
        subprocess.run([str(exe), "fill", str(env_dir), str(a.tables), str(a.rows), str(a.bytes)], check=True)
        steps = draw_steps(np.random.default_rng(0), a.tables, a.rows, a.step_rows, a.steps or (30 if a.quick else 60))
        write_ids(tmp / "ids", steps)
        nat, py = [], []
        load = os.getloadavg()[0]
        for _ in range(a.rounds):
            nat.append(native(exe, env_dir, a.tables, a.bytes, tmp / "ids", tmp / "times"))
            py.append(py_lmdb(env_dir, a.tables, a.bytes, steps))
        load = max(load, os.getloadavg()[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = a.step_rows
    nat, py = np.concatenate(nat), np.concatenate(py)
    out = {}
    for j, op in enumerate(("read", "write")):
        n, p = float(np.median(nat[:, j])) / rows * 1e6, float(np.median(py[:, j])) / rows * 1e6
        out.update({f"native_{op}_us_per_row": round(n, 3), f"py_{op}_us_per_row": round(p, 3),
                    f"py_over_native_{op}": round(p / n, 3)})
    print(f"LMDB per row, {rows} rows a step over {a.tables} tables of {a.rows} ids, {a.bytes}-byte records "
          f"(medians of {len(nat)} steps each; load average {load:.2f}):", file=sys.stderr)
    for op in ("read", "write"):
        print(f"  {op:5s}  C loop {out[f'native_{op}_us_per_row']:6.3f} us   py-lmdb {out[f'py_{op}_us_per_row']:6.3f} us"
              f"   py-lmdb/C x{out[f'py_over_native_{op}']:.2f}", file=sys.stderr)
    n_step = (out["native_read_us_per_row"] + out["native_write_us_per_row"]) * rows / 1e3
    p_step = (out["py_read_us_per_row"] + out["py_write_us_per_row"]) * rows / 1e3
    print(f"  a step's rows read and written: C loop {n_step:.2f} ms, py-lmdb {p_step:.2f} ms", file=sys.stderr)
    print(json.dumps({**out, "native_step_ms": round(n_step, 3), "py_step_ms": round(p_step, 3), "tables": a.tables,
                      "rows": a.rows, "bytes": a.bytes, "step_rows": rows, "steps": len(nat), "load_avg": round(load, 2),
                      "quick": a.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
