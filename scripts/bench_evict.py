"""Victim selection at scale: the LRU/LFU reservoir against a pass over the tier.

A store with a small device tier and a host tier of ``--host`` rows (filled first) looks
up batches of rows it has never seen, so every batch evicts a batch's worth of host rows.
The batch that builds a reservoir (one pass) is timed apart and amortised over the
batches one reservoir lasts (about host/8/batch here).
The same store alternates between its host policy's reservoir (the default) and a full
scan (``policy.reservoir = False``) in rounds, so both see the same tier and machine
state; printed: milliseconds per evicting batch each way and their ratio (scan over amortised), per host size
and policy.  Last line: one JSON object.

    python scripts/bench_evict.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import hiermem as hm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one host size of 1M rows, LRU only (< 60 s)")
    ap.add_argument("--host", type=int, nargs="*", default=None, help="host tier sizes (default 1M 4M 16M)")
    ap.add_argument("--batch", type=int, default=8192, help="new rows per batch")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    sizes = a.host or ([1 << 20] if a.quick else [1 << 20, 1 << 22, 1 << 24])
    policies = ["lru"] if a.quick else ["lru", "lfu"]
    per_round = 4
    out = {}
    tmp = Path(tempfile.mkdtemp(prefix="hiermem-bench-evict-"))
    try:
        for policy in policies:
            for host in sizes:
                s = hm.HierarchicalStore([hm.TableSpec("t", None, 8)],
                                         hm.StoreConfig(path=tmp / f"{policy}-{host}", device_rows=4096,
                                                        host_rows=host, policy=policy))
                nxt = 0
                t0 = time.perf_counter()
                while s.stats()["_store"]["host_occupancy"] < host:  # fill: fresh ids, no evictions yet
                    s.lookup("t", torch.arange(nxt, nxt + (1 << 16)))
                    nxt += 1 << 16
                fill = time.perf_counter() - t0
                pol = s._host.policy
                times = {"reservoir": [], "scan": []}
                build = []  # the batch that builds the reservoir
                for r in range(a.rounds):
                    for mode in ("scan", "reservoir") if r % 2 == 0 else ("reservoir", "scan"):
                        pol.reservoir = mode == "reservoir"
                        t0 = time.perf_counter()
                        s.lookup("t", torch.arange(nxt, nxt + a.batch))  # settle (a reservoir builds here)
                        if mode == "reservoir":
                            build.append(time.perf_counter() - t0)
                        nxt += a.batch
                        t0 = time.perf_counter()
                        for _ in range(per_round):
                            s.lookup("t", torch.arange(nxt, nxt + a.batch))
                            nxt += a.batch
                        times[mode].append((time.perf_counter() - t0) / per_round)
                builds = pol.reservoir_builds
                s.close()
                shutil.rmtree(tmp / f"{policy}-{host}")
                ms = {m: 1e3 * sorted(v)[len(v) // 2] for m, v in times.items()}
                build_ms = 1e3 * sorted(build)[len(build) // 2]
                # a reservoir of about host/8 rows lasts about host/8/batch evicting batches here
                lasts = max(1, max(8 * a.batch, host // 8) // a.batch)
                amortised = ms["reservoir"] + max(0.0, build_ms - ms["reservoir"]) / lasts
                key = f"{policy}_{host}"
                out[key] = {"scan_ms": round(ms["scan"], 2), "reservoir_ms": round(ms["reservoir"], 2),
                            "build_batch_ms": round(build_ms, 2), "batches_per_build": lasts,
                            "reservoir_amortised_ms": round(amortised, 2),
                            "scan_over_reservoir": round(ms["scan"] / amortised, 2),
                            "reservoir_builds": builds}
                print(f"  {policy} host {host:>10,} rows (filled in {fill:.0f} s): scan {ms['scan']:7.1f} ms/batch; "
                      f"reservoir {ms['reservoir']:5.1f} ms/batch, {build_ms:6.1f} ms for the batch that builds it "
                      f"(every ~{lasts} batches): {amortised:5.1f} ms amortised, x{ms['scan'] / amortised:.1f}",
                      file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"batch": a.batch, "quick": a.quick, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
