"""Simulator throughput and LRU miss-ratio-curve cost, against baselines in the same run.

    python scripts/bench_sim.py [--quick] [--accesses N] [--batch IDS]

* ``sim``: hiermem's batch-granular simulator (LRU, LFU) on a Zipf trace (alpha 1.05 over
  1 M rows), batches of 65,536 ids, device 50 k rows + host 200 k rows; accesses/s
  include loading the trace and building the simulator (dense row numbering) as well as
  the replay (reported alone too); the best of two runs.  The dedup of each batch runs
  a batch ahead on a second thread where torch has two or more (``SimConfig.pipeline``).
* ``libcachesim``: its LRU over the same ids (per access, oracleGeneral binary trace;
  trace-file writing not timed).
* ``mrc20``: the exact per-access LRU curve at 20 capacities from one stack-distance pass
  (hiermem.sim.bounds.lru_mrc) vs one simulation (the LRU sim above); ``--quick`` measures
  one simulation and reports 20 x that for "20 separate simulations", the full run times
  20 of them.

* ``per_access``: the same simulator on a trace of single-id batches (the form most cache
  traces have: ``--per-access`` accesses of the same Zipf stream), device tier only
  (50k rows), LRU and LFU, replayed in one compiled loop; against libcachesim's LRU on
  the same ids in the same run (hits must agree exactly), and against a floor measured
  in the same run: a bare per-access LRU over arrays (a doubly linked list of slots and a
  direct id -> slot array, ~40 lines of numba; same hits), the least work an exact LRU
  replay does per access on this machine.  ``per_access_over_floor`` is the share of
  that speed the simulator keeps while running the store's placement (two tiers, pins,
  counters, the reservoir victim search).

The compiled kernels are loaded (or compiled) by a small warm-up replay first, not timed.
The last line is JSON with ``sim_accesses_per_s``, ``per_access_accesses_per_s``,
``per_access_over_libcachesim``, ``per_access_over_floor``, ``libcachesim_accesses_per_s`` and
``mrc20_over_single``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.nn.data import ZipfIds  # noqa: E402
from hiermem.sim import SimConfig, Simulator, simulate, write_trace  # noqa: E402
from hiermem.observe.trace import Trace  # noqa: E402
from hiermem.sim.bounds import dense_ids, lru_mrc, next_use  # noqa: E402


def _trace(tmp: Path, n: int, batch: int) -> tuple[Path, np.ndarray]:
    ids = ZipfIds(1_000_000, 1.05, 0)(n)
    nb = n // batch
    ids = ids[:nb * batch]
    return write_trace(tmp / "zipf", ["z"], ids, np.full((nb, 1), batch)), ids


def _sim(path: Path, policy: str, device: int, host: int, runs: int = 2) -> tuple[float, object]:
    """The best of ``runs`` whole simulations (trace loading included): the first read of
    a trace just written competes with the kernel writing it back (0.02-0.3 s here)."""
    best = None
    for _ in range(runs):
        t0 = time.perf_counter()
        r = simulate(path, SimConfig(device_rows=device, host_rows=host, policy=policy))
        secs = time.perf_counter() - t0
        if best is None or secs < best[0]:
            best = (secs, r)
    return best


def _libcachesim(tmp: Path, ids: np.ndarray, cap: int) -> tuple[float | None, int | None]:
    try:
        import libcachesim as lcs
    except ImportError:
        return None, None
    d = dense_ids(ids)
    nxt = next_use(d)
    rec = np.zeros(ids.size, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("sz", "<u4"), ("nx", "<i8")]))
    rec["t"] = np.arange(ids.size) // 1000
    rec["id"] = d + 1
    rec["sz"] = 1
    rec["nx"] = np.where(nxt < ids.size, nxt, -1)
    f = tmp / "zipf.oracleGeneral"
    rec.tofile(f)
    t0 = time.perf_counter()
    ratio, _ = lcs.LRU(cap, hashpower=21).process_trace(lcs.TraceReader(str(f), lcs.TraceType.ORACLE_GENERAL_TRACE))
    return time.perf_counter() - t0, round(ratio * ids.size)


@numba.njit(nogil=True)  # not cached: scripts are loaded under several module names
def _floor_lru(ids, n_rows, cap):
    """Hits of a per-access LRU of ``cap`` rows over ``ids`` (int64 in ``[0, n_rows)``): a
    doubly linked list of slots, a direct id -> slot array; the same-run floor."""
    slot = np.full(n_rows, -1, np.int64)
    key = np.empty(cap, np.int64)
    prev = np.empty(cap, np.int64)
    nxt = np.empty(cap, np.int64)
    head = tail = np.int64(-1)
    used = hits = np.int64(0)
    for i in range(ids.size):
        r = ids[i]
        s = slot[r]
        if s >= 0:
            hits += 1
            if s != head:  # unlink, then in front
                p, q = prev[s], nxt[s]
                nxt[p] = q
                if q >= 0:
                    prev[q] = p
                else:
                    tail = p
                prev[s] = -1
                nxt[s] = head
                prev[head] = s
                head = s
            continue
        if used < cap:
            s = used
            used += 1
        else:  # the least recent row leaves
            s = tail
            slot[key[s]] = -1
            tail = prev[s]
            nxt[tail] = -1
        key[s] = r
        slot[r] = s
        prev[s] = -1
        nxt[s] = head
        if head >= 0:
            prev[head] = s
        head = s
        if tail < 0:
            tail = s
    return hits


def floor_lru(ids: np.ndarray, cap: int) -> tuple[float, int]:
    """``(accesses/s, hits)`` of the bare LRU of ``cap`` rows on ``ids``, the best of three
    runs (it is the floor); compiled (or loaded) before the timing."""
    n_rows = int(ids.max()) + 1
    _floor_lru(ids[:64], n_rows, 8)
    best, hits = None, 0
    for _ in range(3):
        t0 = time.perf_counter()
        hits = int(_floor_lru(ids, n_rows, cap))
        secs = time.perf_counter() - t0
        best = secs if best is None else min(best, secs)
    return ids.size / best, hits


def _floor(ids: np.ndarray, cap: int, out: dict) -> None:
    """The per-access replay against the bare LRU on the same ids."""
    rate, hits = floor_lru(ids, cap)
    out["floor_lru_accesses_per_s"], out["floor_lru_hits"] = rate, hits
    out["per_access_over_floor"] = out["per_access_lru_accesses_per_s"] / rate
    out["per_access_hits_equal_floor"] = hits == out["per_access_lru_hits"]
    print(f"floor (bare numba LRU) on the same ids: {rate / 1e6:.2f} M accesses/s; "
          f"simulator / floor {out['per_access_over_floor']:.2f}; hits equal: {out['per_access_hits_equal_floor']}")


def _per_access(tmp: Path, ids: np.ndarray, cap: int, out: dict) -> None:
    """Single-id batches through the simulator (LRU, LFU) and libcachesim's LRU."""
    n = ids.size
    tr = Trace(tmp, ("z",), ids, np.ones((n, 1), dtype=np.int64), False)
    for policy in ("lru", "lfu"):
        sim = Simulator(tr, SimConfig(device_rows=cap, host_rows=0, policy=policy, updates=False))
        t0 = time.perf_counter()
        r = sim.run()
        secs = time.perf_counter() - t0
        out[f"per_access_{policy}_accesses_per_s"] = n / secs
        out[f"per_access_{policy}_hits"] = r.device_hits
        print(f"per-access {policy}: {n / secs / 1e6:.2f} M accesses/s, hit rate {r.hit_rate:.4f}")
    out["per_access_accesses_per_s"] = min(out["per_access_lru_accesses_per_s"], out["per_access_lfu_accesses_per_s"])
    secs, misses = _libcachesim(tmp, ids, cap)
    if secs is not None:
        out["per_access_libcachesim_accesses_per_s"] = n / secs
        out["per_access_over_libcachesim"] = out["per_access_lru_accesses_per_s"] / (n / secs)
        out["per_access_hits_equal_libcachesim"] = n - misses == out["per_access_lru_hits"]
        print(f"libcachesim LRU on the same ids: {n / secs / 1e6:.2f} M accesses/s; "
              f"hits equal: {out['per_access_hits_equal_libcachesim']}")
    _floor(ids, cap, out)


def _warm_up() -> None:
    """Load (or compile) the kernels outside the timed runs."""
    ids = np.arange(64, dtype=np.int64) % 7
    for lens in (np.ones((64, 1), dtype=np.int64), np.full((16, 1), 4, dtype=np.int64)):
        tr = Trace(Path("."), ("z",), ids, lens, True)
        for policy in ("lru", "lfu"):
            for pipeline in (False, True):  # the single loop and the two-thread replay's kernels
                simulate(tr, SimConfig(device_rows=3, host_rows=2, policy=policy, pipeline=pipeline))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="< 60 s: one simulation stands for each of the 20")
    ap.add_argument("--accesses", type=int, default=10_000_000)
    ap.add_argument("--batch", type=int, default=65_536, help="ids per batch (e.g. 2048 samples x 32 features)")
    ap.add_argument("--per-access", type=int, default=None, help="accesses of the per-access replay "
                    "(default 10M, --quick 2M)")
    a = ap.parse_args()
    _warm_up()
    D, H = 50_000, 200_000
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        path, ids = _trace(tmp, a.accesses, a.batch)
        n = ids.size
        out: dict = {"accesses": n, "batch_ids": a.batch, "device_rows": D, "host_rows": H}
        for policy in ("lru", "lfu"):
            secs, r = _sim(path, policy, D, H)
            out[f"sim_{policy}_seconds"] = secs
            out[f"sim_{policy}_accesses_per_s"] = n / secs
            out[f"sim_{policy}_device_hit_rate"] = r.hit_rate
            out[f"sim_{policy}_replay_accesses_per_s"] = n / r.seconds  # without loading + dense numbering
            print(f"sim {policy}: {secs:.2f} s, {n / secs / 1e6:.2f} M accesses/s "
                  f"(replay alone {n / r.seconds / 1e6:.2f} M/s), device hit rate {r.hit_rate:.4f}")
        secs, misses = _libcachesim(tmp, ids, D)
        if secs is not None:
            out["libcachesim_lru_seconds"] = secs
            out["libcachesim_accesses_per_s"] = n / secs
            out["libcachesim_lru_misses"] = misses
            print(f"libcachesim LRU (per access): {secs:.2f} s, {n / secs / 1e6:.2f} M accesses/s")
        t0 = time.perf_counter()
        mrc = lru_mrc(ids)
        caps = np.unique(np.geomspace(1000, 400_000, 20).astype(np.int64))
        curve = mrc.misses(caps)
        mrc_secs = time.perf_counter() - t0
        out["mrc20_seconds"] = mrc_secs
        out["mrc_lru_misses_at_device_rows"] = mrc.misses(D)
        if misses is not None:
            out["mrc_equals_libcachesim"] = mrc.misses(D) == misses
        single = out["sim_lru_seconds"]
        if a.quick:
            twenty = 20 * single
        else:
            t0 = time.perf_counter()
            for c in caps:
                simulate(path, SimConfig(device_rows=int(c), host_rows=H, policy="lru"))
            twenty = time.perf_counter() - t0
        out["twenty_sims_seconds"] = twenty
        out["twenty_sims_measured"] = not a.quick
        out["mrc20_over_single"] = mrc_secs / single
        out["mrc20_over_twenty"] = mrc_secs / twenty
        print(f"LRU curve, 20 capacities: {mrc_secs:.2f} s (one pass) vs one simulation {single:.2f} s, "
              f"20 simulations {twenty:.2f} s{'' if not a.quick else ' (20 x one)'}; "
              f"misses at 1k..400k: {curve.tolist()[:3]}...")
        out["sim_accesses_per_s"] = min(out["sim_lru_accesses_per_s"], out["sim_lfu_accesses_per_s"])
        out.setdefault("libcachesim_accesses_per_s", None)
        _per_access(tmp, ids[:a.per_access or (2_000_000 if a.quick else 10_000_000)], 50_000, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
