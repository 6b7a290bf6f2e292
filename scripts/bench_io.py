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

    python scripts/bench_io.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hiermem.tiers.disk import DiskTier
from hiermem.tiers import lmdb_process

W = 16


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rows, shorter phases (< 30 s)")
    ap.add_argument("--rows", type=int, default=None, help="rows in LMDB (default 800k, quick 200k)")
    ap.add_argument("--reads", type=int, default=13_000, help="rows read ahead per background round")
    ap.add_argument("--writes", type=int, default=10_000, help="rows written behind per background round")
    ap.add_argument("--rate", type=float, default=4.0,
                    help="background rounds per second (a step's I/O each; in-thread sustains about 5 here)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per phase (default 8, quick 3)")
    a = ap.parse_args(argv)
    if not lmdb_process.supported():
        print("bench_io: I/O processes need Linux", file=sys.stderr)
        return 0
    rows = a.rows or (200_000 if a.quick else 800_000)
    seconds = a.seconds or (3.0 if a.quick else 8.0)
    tmp = Path(tempfile.mkdtemp(prefix="hiermem-bench-io-"))
    try:
        path = tmp / "lmdb"
        d = DiskTier(path, create=True, sync=False)
        for i in range(0, rows, 100_000):
            ids = np.arange(i, min(rows, i + 100_000))
            d.write([(0, ids, np.zeros((len(ids), W), dtype=np.float32))])
        d.close()
        alone = foreground(seconds)
        fg_t, bg_t = phase(path, False, rows, a.reads, a.writes, a.rate, seconds)
        fg_p, bg_p = phase(path, True, rows, a.reads, a.writes, a.rate, seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"bench_io: {rows} rows x {W} floats; per background round {a.reads} reads + {a.writes} writes, "
          f"at most {a.rate:g} rounds/s",
          file=sys.stderr)
    print(f"  foreground alone        {alone:9.0f} units/s", file=sys.stderr)
    print(f"  beside in-thread I/O    {fg_t:9.0f} units/s  x{fg_t / alone:.2f}   background {bg_t:6.1f} rounds/s",
          file=sys.stderr)
    print(f"  beside the I/O process  {fg_p:9.0f} units/s  x{fg_p / alone:.2f}   background {bg_p:6.1f} rounds/s",
          file=sys.stderr)
    print(json.dumps({"fg_in_thread_over_alone": round(fg_t / alone, 3), "fg_io_process_over_alone": round(fg_p / alone, 3),
                      "bg_io_process_over_in_thread": round(bg_p / bg_t, 3), "rate": a.rate, "rows": rows,
                      "quick": a.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
