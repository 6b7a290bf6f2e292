"""Measure the cost model's defaults on this machine (hiermem.sim.cost.CostModel).

    python scripts/measure_costs.py

* host_to_device / device_to_host: gathering rows of a host tier into device slots
  (``index_copy_``; on a CUDA machine, pinned host -> GPU and back).
* disk_read / disk_write: batched LMDB reads and write-back transactions of rows through
  :class:`hiermem.tiers.DiskTier` (64-float rows, 16 k rows per batch).
* device_accesses_per_s: gather + SGD update of resident rows (``HierarchicalStore``
  all-device lookup + update of 64-dim rows).

Prints a CostModel(...) line and JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hiermem as hm  # noqa: E402
from hiermem.tiers import DiskTier  # noqa: E402

ROWS, W, REPS = 16_384, 64, 20


def _best(fn, reps: int = REPS) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    host = torch.randn(200_000, W, pin_memory=dev == "cuda")
    slots = torch.zeros(100_000, W, device=dev)
    src = torch.randint(0, host.shape[0], (ROWS,))
    dst = torch.randint(0, slots.shape[0], (ROWS,), device=dev)
    nbytes = ROWS * W * 4

    def h2d():
        slots.index_copy_(0, dst, host.index_select(0, src).to(dev, non_blocking=True))
        if dev == "cuda":
            torch.cuda.synchronize()

    def d2h():
        host.index_copy_(0, src, slots.index_select(0, dst).cpu())

    out = {"host_to_device": nbytes / _best(h2d), "device_to_host": nbytes / _best(d2h)}
    with tempfile.TemporaryDirectory() as td:
        disk = DiskTier(Path(td) / "db", create=True, map_size=1 << 30, sync=False)  # as the store
        rng = np.random.default_rng(0)
        recs = rng.standard_normal((ROWS, W), dtype=np.float32)
        keys = [np.arange(i * ROWS, (i + 1) * ROWS, dtype=np.int64) for i in range(REPS)]
        t = []
        for k in keys:
            t0 = time.perf_counter()
            disk.write([(0, k, recs)])
            t.append(time.perf_counter() - t0)
        out["disk_write"] = nbytes / min(t)
        t = []
        for k in keys:
            q = rng.permutation(k)
            t0 = time.perf_counter()
            disk.read(0, q, W)
            t.append(time.perf_counter() - t0)
        out["disk_read"] = nbytes / min(t)
        disk.close()
        store = hm.HierarchicalStore([hm.TableSpec("t", 50_000, W)],
                                     hm.StoreConfig(path=Path(td) / "s", device=dev, device_rows=60_000, host_rows=1))
        ids = torch.randint(0, 50_000, (ROWS,))
        g = torch.ones(ROWS, W)
        store.lookup("t", torch.arange(50_000))

        def step():
            store.lookup("t", ids)
            store.update("t", ids, g)
        out["device_accesses_per_s"] = ROWS / _best(step, 10)
        store.close()
    print("CostModel(" + ", ".join(f"{k}={v:.3g}" for k, v in out.items()) + ")")
    print(json.dumps({"device": dev, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
