"""The compiled control plane against the memory work it decides: ratios to same-run floors.

    python scripts/bench_core.py [--quick]

Each figure is ns per id / row / access and a ratio to a floor measured in the same run:
the plain numpy / torch work on the same ids and rows that no placement can avoid.

* ``probe``: a batch of 64k Zipf(1.05) ids, all resident (index of 1M slots), through the
  index kernel: a bounded 8M-row table (direct map) and an unbounded one (hashed 64-bit
  ids).  Floor: gathering one int64 per id from an array of 8M entries at the same ids,
  timed alternately with the kernel (both see the same cache and load).
* ``swap``: a batch of 9k distinct rows that all come up from the host tier while as
  many device rows go down (device 100k rows, host 1M, records of 68 floats = 272 bytes,
  LRU and LFU), through the store's own placement (decide, commit, record copies; the
  dedup of the batch is done beforehand).  Floor: the fastest plain copy of the same
  records up and down (numpy fancy indexing, or torch ``index_select``/``index_copy_``),
  on fresh random slots each time (cold records, like the swap's), alternated with it.
* ``disk_miss_plan``: a batch of 9k rows new to the tiers while both are full: device
  victims go down to the host, host victims are written down (LMDB excluded: the read
  returns ready records and the write is dropped).  Floor: the same record copies
  (disk records in, device rows down, host rows gathered for the write).
* ``replay``: a per-access trace (one id per batch) of Zipf(1.05) over 1M rows through
  the simulator's compiled loop (the store's kernels), a 50k-row device tier.  Floor: a
  bare per-access LRU over arrays on the same ids (``bench_sim``'s, ~40 lines of numba):
  ``replay_over_floor`` is the share of its speed the replay keeps.

Last line: one JSON object (``probe_ratio``, ``probe_bounded_ratio``, ``swap_ratio``,
``disk_miss_plan_ratio``, ``replay_accesses_per_s``, ``replay_over_floor`` and the ns figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hiermem as hm  # noqa: E402
import bench_sim  # noqa: E402  (the replay's floor)
from hiermem.core import index as ixk  # noqa: E402
from hiermem.core.index import KeyIndex  # noqa: E402
from hiermem.nn.data import ZipfIds  # noqa: E402
from hiermem.sim import SimConfig, Simulator  # noqa: E402
from hiermem.observe.trace import Trace  # noqa: E402

WIDTH = 68  # floats per record: dim 67 + row-wise Adagrad's one state


def best_pair(fn, floor_fn, reps: int) -> tuple[float, float]:
    """Fastest of ``reps`` timed calls of ``fn`` and of ``floor_fn``, alternated: both see
    the same cache and load (the probes are cache-resident Zipf lookups, so a floor timed
    apart, while another process wipes the shared cache, moved the ratio from 1 to 4)."""
    sec, floor = float("inf"), float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        floor_fn()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        floor, sec = min(floor, t1 - t0), min(sec, t2 - t1)
    return sec, floor


def bench_probe(reps: int) -> dict:
    n_rows, batch = 8_000_000, 65_536
    ids = ZipfIds(n_rows, 1.05, 0)(batch).astype(np.int64)
    floor_arr = np.arange(n_rows, dtype=np.int64)
    out = {}
    hashed = (ids * np.int64(0x9E3779B97F4A7C1)) & np.int64((1 << 62) - 1)  # unbounded: 64-bit hashed ids
    for kind, keys, sizes in (("bounded", ids, [n_rows]), ("unbounded", hashed, [None])):
        ix = KeyIndex(1 << 20, sizes)
        u = np.unique(keys)
        ix.insert(np.zeros(u.size, np.int64), u, np.arange(u.size, dtype=np.int64))
        t = np.zeros(batch, dtype=np.int64)
        res = np.empty(batch, dtype=np.int64)
        ixk.find(ix.meta, ix.offsets, ix.slot_of, ix.tab, t, keys, res)
        assert (res >= 0).all()
        sec, floor = best_pair(lambda: ixk.find(ix.meta, ix.offsets, ix.slot_of, ix.tab, t, keys, res),
                               lambda: floor_arr[ids], 4 * reps)  # 64k ids: a fraction of a ms each
        out[f"probe_{kind}_floor_ns"] = floor / batch * 1e9
        out[f"probe_{kind}_ns"] = sec / batch * 1e9
        out[f"probe_{kind}_ratio"] = sec / floor
    out["probe_floor_ns"] = out["probe_bounded_floor_ns"]
    return out


def _store(tmp: Path, name: str, policy: str, device: int, host: int, rows: int) -> hm.HierarchicalStore:
    return hm.HierarchicalStore([hm.TableSpec("t", rows, WIDTH - 1)],
                                hm.StoreConfig(path=tmp / name, device_rows=device, host_rows=host, policy=policy,
                                               optimizer=hm.RowWiseAdagrad(lr=0.1)))


def _fill(s: hm.HierarchicalStore, rows: int) -> None:
    for a in range(0, rows, 1 << 17):
        s.lookup("t", torch.arange(a, min(rows, a + (1 << 17))))


def _copy_floor(dst_up, src_up, i_up, j_up, dst_dn, src_dn, i_dn, j_dn) -> float:
    """One timed plain copy of records ``src_up[i_up] -> dst_up[j_up]`` and
    ``src_dn[i_dn] -> dst_dn[j_dn]``: the faster of torch and numpy, each on its own
    fresh slots (``i_up`` etc. are pairs: ``[0]`` for torch, ``[1]`` for numpy).

    Fresh slots per call: the records a placement moves are cold (random rows of tiers
    far larger than the cache), and a floor repeated on the same 2 x 9k records found
    them in the last level cache (4.9 MB of 32): it measured 1.3-1.8x less than the same
    copy of cold records, and by how much depended on what other processes had evicted."""
    def torch_copy(i_up, j_up, i_dn, j_dn):
        a = src_up.index_select(0, i_up)
        b = src_dn.index_select(0, i_dn)
        dst_up.index_copy_(0, j_up, a)
        dst_dn.index_copy_(0, j_dn, b)
    nu, nd = dst_up.numpy(), dst_dn.numpy()
    su, sd = src_up.numpy(), src_dn.numpy()

    def numpy_copy(i_up, j_up, i_dn, j_dn):
        a = su[i_up]
        b = sd[i_dn]
        nu[j_up] = a
        nd[j_dn] = b
    out = float("inf")
    for c, x in ((torch_copy, 0), (numpy_copy, 1)):
        args = [v[x] if x == 0 else v[x].numpy() for v in (i_up, j_up, i_dn, j_dn)]
        t0 = time.perf_counter()
        c(*args)
        out = min(out, time.perf_counter() - t0)
    return out


def _fresh(g: torch.Generator, size: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sets of ``n`` distinct random slots of ``[0, size)`` (torch's and numpy's floor)."""
    return torch.randperm(size, generator=g)[:n], torch.randperm(size, generator=g)[:n]


def bench_swap(tmp: Path, policy: str, reps: int, quick: bool) -> dict:
    D, H, n = 100_000, (400_000 if quick else 1_000_000), 9_000
    s = _store(tmp, f"swap-{policy}", policy, D, H, 4 * (D + H))
    try:
        _fill(s, D + H)
        rng = np.random.default_rng(1)
        g = torch.Generator().manual_seed(2)
        dev, host = s._dev.data.clone(), s._host.data.clone()  # the floor's own tiers (pages touched)
        sec = floor = float("inf")
        for _ in range(reps):  # the floor and the swap alternate: both see the same load
            host_rows = s._host.keys_k[s._host.keys_t >= 0].numpy()
            ids = torch.from_numpy(rng.choice(host_rows, n, replace=False))
            b = s._batch(0, ids)
            clock = b.lastpos + s._clock
            hs, ds = _fresh(g, H, n), _fresh(g, D, n)
            floor = min(floor, _copy_floor(dev, host, hs, ds, host, dev, ds, hs))
            t0 = time.perf_counter()
            p = s._res.resolve(b, clock, True)
            sec = min(sec, time.perf_counter() - t0)
            s._clock += n
            assert p.on_device is None  # all came up
        st = s.stats()["t"]
        assert st["device"]["evictions"] >= n * reps
    finally:
        s.close()
    return {f"swap_{policy}_ns_per_row": sec / n * 1e9, f"swap_{policy}_floor_ns_per_row": floor / n * 1e9,
            f"swap_{policy}_ratio": sec / floor}


def bench_disk_miss(tmp: Path, policy: str, reps: int, quick: bool) -> dict:
    D, H, n = 100_000, (400_000 if quick else 1_000_000), 9_000
    s = _store(tmp, f"miss-{policy}", policy, D, H, 8 * (D + H))
    try:
        _fill(s, D + H)
        s._host.dirty[:] = True  # every host victim is written down
        rec = torch.zeros((n, WIDTH))
        s._res.read = lambda t, k: (rec[:k.numel()], torch.zeros(k.numel(), dtype=torch.bool))  # LMDB excluded
        s._res.write_down = lambda rows, meta=True, sync=False: 0
        nxt = D + H
        g = torch.Generator().manual_seed(3)
        dev, host = s._dev.data.clone(), s._host.data.clone()  # the floor's own tiers (pages touched)
        all_rec = (torch.arange(n),) * 2
        sec = floor = float("inf")
        for _ in range(reps):  # the floor and the placement alternate: both see the same load
            b = s._batch(0, torch.arange(nxt, nxt + n))
            nxt += n
            hs, ds, hv = _fresh(g, H, n), _fresh(g, D, n), torch.randperm(H, generator=g)[:n]
            t0 = time.perf_counter()
            host.index_select(0, hv)  # host victims gathered for the write
            fl = time.perf_counter() - t0
            floor = min(floor, fl + _copy_floor(dev, rec, all_rec, ds, host, dev, ds, hs))
            t0 = time.perf_counter()
            s._res.resolve(b, b.lastpos + s._clock, True)
            sec = min(sec, time.perf_counter() - t0)
            s._clock += n
            s._host.dirty[:] = True
    finally:
        del s._res.read, s._res.write_down
        s.close()
    return {f"disk_miss_plan_{policy}_ns_per_row": sec / n * 1e9,
            f"disk_miss_plan_{policy}_floor_ns_per_row": floor / n * 1e9, f"disk_miss_plan_{policy}_ratio": sec / floor}


def bench_replay(policy: str, ids: np.ndarray) -> dict:
    tiny = Trace(Path("."), ("z",), np.arange(64, dtype=np.int64) % 7, np.ones((64, 1), dtype=np.int64), False)
    Simulator(tiny, SimConfig(device_rows=3, host_rows=0, policy=policy, updates=False)).run()  # load/compile, untimed
    accesses = ids.size
    tr = Trace(Path("."), ("z",), ids, np.ones((accesses, 1), dtype=np.int64), False)
    sim = Simulator(tr, SimConfig(device_rows=50_000, host_rows=0, policy=policy, updates=False))
    t0 = time.perf_counter()
    r = sim.run()
    sec = time.perf_counter() - t0
    return {f"replay_{policy}_accesses_per_s": accesses / sec, f"replay_{policy}_hit_rate": r.hit_rate,
            f"replay_{policy}_hits": r.device_hits}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="< 60 s: host tier 400k rows, fewer repetitions")
    ap.add_argument("--accesses", type=int, default=10_000_000, help="per-access replay length")
    a = ap.parse_args(argv)
    reps = 5 if a.quick else 15
    torch.set_num_threads(1)  # one core's work against one core's floor
    out: dict = {}
    t0 = time.perf_counter()
    out.update(bench_probe(reps))
    with tempfile.TemporaryDirectory(prefix="hiermem-bench-core-") as td:
        for policy in ("lru", "lfu"):
            out.update(bench_swap(Path(td), policy, reps, a.quick))
            out.update(bench_disk_miss(Path(td), policy, reps, a.quick))
    ids = ZipfIds(1_000_000, 1.05, 7)(a.accesses).astype(np.int64)
    for policy in ("lru", "lfu"):
        out.update(bench_replay(policy, ids))
    rate, hits = bench_sim.floor_lru(ids, 50_000)  # the bare numba LRU on the same ids: the replay's floor
    out["replay_floor_accesses_per_s"] = rate
    out["replay_lru_hits_equal_floor"] = hits == out["replay_lru_hits"]
    out["probe_ratio"] = out["probe_unbounded_ratio"]
    out["probe_bounded_ratio"] = out["probe_bounded_ratio"]
    out["swap_ratio"] = max(out["swap_lru_ratio"], out["swap_lfu_ratio"])
    out["disk_miss_plan_ratio"] = max(out["disk_miss_plan_lru_ratio"], out["disk_miss_plan_lfu_ratio"])
    out["replay_accesses_per_s"] = min(out["replay_lru_accesses_per_s"], out["replay_lfu_accesses_per_s"])
    out["replay_over_floor"] = out["replay_accesses_per_s"] / out["replay_floor_accesses_per_s"]
    out["seconds"] = time.perf_counter() - t0
    for k in ("probe", "probe_bounded", "swap", "disk_miss_plan"):
        print(f"{k:16s} ratio to floor {out[k + '_ratio']:.2f}")
    for p in ("lru", "lfu"):
        print(f"swap {p}: {out[f'swap_{p}_ns_per_row']:.0f} ns/row (floor {out[f'swap_{p}_floor_ns_per_row']:.0f}); "
              f"disk miss {out[f'disk_miss_plan_{p}_ns_per_row']:.0f} ns/row "
              f"(floor {out[f'disk_miss_plan_{p}_floor_ns_per_row']:.0f}); "
              f"replay {out[f'replay_{p}_accesses_per_s'] / 1e6:.1f} M accesses/s")
    print(f"replay floor (bare numba LRU, same ids): {out['replay_floor_accesses_per_s'] / 1e6:.1f} M accesses/s; "
          f"replay / floor {out['replay_over_floor']:.2f}; LRU hits equal: {out['replay_lru_hits_equal_floor']}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
