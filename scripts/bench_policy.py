"""Hit rates of every hiermem policy against every libCacheSim algorithm and Belady, per access.

    python scripts/bench_policy.py [--quick | --tiny] [--accesses N] [--json FILE]

Three traces: the shared MovieLens trace (movie ids by rating time, ``import_movielens``),
the shared Criteo head (the global (field, value) stream, sample by sample and table by
table, ``import_criteo`` numbered by ``dense_rows``) and a synthetic Zipf 1.05 trace
(``ZipfIds``).  Each is one id stream, replayed per access (batch size 1) through a
single-tier cache of 2% and 10% of the trace's distinct rows:

* ``hiermem``: every policy of the registry (``hiermem.core.policies.POLICIES``) with
  its default parameters, ``lfu_decay`` also at half-lives of 1% and 10% of the trace,
  and every policy whose constructor takes ``admission`` also with ``admission="tinylfu"``
  (a row of its own); ``simulate(trace, SimConfig(device_rows=cap, host_rows=0, ...))``:
  device victims go to disk, a single-tier cache like libCacheSim's.  Policies that want
  lookahead (``wants_lookahead``) run in the lookahead part instead.
* ``libcachesim``: every subclass of ``lcs.CacheBase`` in the installed version that
  builds as ``cls(cache_size, hashpower=...)`` (the others are listed with the reason),
  on an oracleGeneral file of the same ids (unit sizes).  Not installed: a line says so
  and its figures are None.
* ``belady``: Belady's MIN per access (``hiermem.sim.bounds.belady_misses``).
* ``lookahead``: the ``lookahead`` policy at batches of ``--batch`` (10) accesses, windows
  0, 1, 2, 4, 8, 16, 32, 64 batches, over Belady's per-access hit rate, over the base
  ``--base`` (default ``s3fifo``; ``--bases`` adds window 16 over each base).  It runs at
  prefetch depth 0 where the installed simulator gives lookahead at depth 0 (a probe
  checks), else at depth 1; window 0 is "no lookahead": lookahead with window 0 at depth
  0 where supported, else plain ``lru`` at the same batches (the label says which).
  ``base`` is passed only where ``Lookahead.__init__`` takes it.

``--quick`` replays prefixes of 60k accesses of each trace (Zipf: 60k accesses over 20k
ids); the default replays the whole shared traces and Zipf 300k over 100k ids; ``--tiny``
(5k accesses) is the smoke test's.  The sanity check: hiermem's ``lru`` and
libCacheSim's LRU miss on exactly the same accesses (counts compared) everywhere.

Last line: JSON with ``worst_gap_to_libcachesim_pts`` (min over trace x size of the best
hiermem online policy's hit rate, its ``+tinylfu`` admission variants included, minus the
best libCacheSim online algorithm's, in percentage points; Belady, BeladySize and
lookahead policies excluded: ``gap_excludes``; target >= -0.3), ``admission_off_on``
(per trace and size, each policy's hit rate without and with ``admission="tinylfu"``), ``worst_lookahead_over_belady`` (lookahead window 16 over Belady, min
over trace x size; target >= 0.92), ``lookahead_window_curve``, ``tables`` (every hit
rate), ``targets_met`` and ``seconds`` (where the time went).
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hiermem.core.policies import POLICIES, PolicySpec  # noqa: E402
from hiermem.nn.data import ZipfIds, shared_data_dir  # noqa: E402
from hiermem.sim import SimConfig, load_trace, simulate, write_trace  # noqa: E402
from hiermem.sim.bounds import belady_misses, dense_ids, next_use  # noqa: E402
from hiermem.sim.datasets import import_criteo, import_movielens  # noqa: E402
from hiermem.sim.engine import dense_rows  # noqa: E402

try:
    import libcachesim as lcs
except ImportError:  # hiermem[peers]
    lcs = None

SIZES = (0.02, 0.10)
WINDOWS = (0, 1, 2, 4, 8, 16, 32, 64)
TARGET_WINDOW = 16
TARGET_GAP_PTS = -0.3
TARGET_LOOKAHEAD = 0.92
LOOKAHEAD_BASES = ("lru", "lfu", "lfu_decay", "sieve", "s3fifo", "arc", "wtinylfu")
#: libCacheSim algorithms that read the future (the trace's next-access field)
LCS_ORACLES = ("Belady", "BeladySize")
GAP_EXCLUDES = ["libCacheSim Belady", "libCacheSim BeladySize", "hiermem belady bound",
                "hiermem policies with wants_lookahead (lookahead)"]
MODES = {  # prefix accesses of the shared traces (None: whole), Zipf accesses, Zipf ids
    "tiny": (5_000, 5_000, 2_000),
    "quick": (60_000, 60_000, 20_000),
    "full": (None, 300_000, 100_000),
}


# -- traces --------------------------------------------------------------------------------
def load_streams(tmp: Path, prefix: int | None, zipf_n: int, zipf_items: int) -> dict:
    """``name -> (ids, note)`` (int64 dense ids, per access) or ``name -> (None, reason)``."""
    out = {}
    for name, imp in (("movielens", import_movielens), ("criteo", import_criteo)):
        try:
            tr = load_trace(imp(tmp / f"src-{name}", 1))  # read in place, never copied
        except Exception as e:  # noqa: BLE001 - shared data absent: skip the trace
            out[name] = (None, f"skipped: {e}")
            continue
        ids = dense_rows(tr)[0]
        whole = ids.size
        if prefix is not None and prefix < whole:
            ids = ids[:prefix]
        out[name] = (np.ascontiguousarray(dense_ids(ids)),
                     f"first {ids.size} of {whole} accesses" if ids.size < whole else f"whole trace ({whole} accesses)")
    z = ZipfIds(zipf_items, 1.05, 0)(zipf_n)
    out["zipf1.05"] = (dense_ids(z), f"{zipf_n} accesses over {zipf_items} ids (seed 0)")
    return out


def one_table(path: Path, ids: np.ndarray, batch: int):
    full, rest = divmod(ids.size, batch)
    lens = np.array([batch] * full + ([rest] if rest else []), dtype=np.int64).reshape(-1, 1)
    return load_trace(write_trace(path, ["t"], ids, lens, updates=False))


def oracle_file(path: Path, ids: np.ndarray) -> Path:
    """An oracleGeneral trace of ``ids`` (unit sizes, next use filled), as tests/test_sim.py."""
    nxt = next_use(ids)
    rec = np.zeros(ids.size, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("sz", "<u4"), ("nx", "<i8")]))
    rec["t"] = np.arange(ids.size)
    rec["id"] = ids + 1
    rec["sz"] = 1
    rec["nx"] = np.where(nxt < ids.size, nxt, -1)
    rec.tofile(path)
    return path


# -- hiermem -------------------------------------------------------------------------------
def project_variants(accesses: int) -> list[tuple[str, str, dict]]:
    """``(label, policy, params)`` of every online registry policy (default parameters,
    lfu_decay's half-lives, ``admission="tinylfu"`` where taken)."""
    out = []
    for name, cls in sorted(POLICIES.items()):
        if cls.wants_lookahead:
            continue
        out.append((name, name, {}))
        if name == "lfu_decay":
            for f in (0.01, 0.10):
                out.append((f"lfu_decay hl={f:.0%}", name, {"half_life": float(max(1, round(f * accesses)))}))
        if name == "s3fifo":
            for f in (0.05, 0.20):
                out.append((f"s3fifo small={f:.0%}", name, {"small": f}))
        if name == "wtinylfu":
            out.append(("wtinylfu window=10%", name, {"window": 0.10}))
        if "admission" in inspect.signature(cls.__init__).parameters:
            out.append((f"{name}+tinylfu", name, {"admission": "tinylfu"}))
    return out


def lookahead_depth(tmp: Path) -> int:
    """0 where the installed simulator gives lookahead at prefetch depth 0, else 1: on a
    cycle one longer than the cache LRU never hits; lookahead does if it acts.  Also
    loads (or compiles) the kernels every later run uses, before any worker starts."""
    tr = one_table(tmp / "probe", np.tile(np.arange(7, dtype=np.int64), 12), 1)
    lru = simulate(tr, SimConfig(device_rows=6, host_rows=0, policy="lru")).device_hits
    belady_misses(tr.ids, 6)
    la = PolicySpec("lookahead", {"window": 4})
    simulate(tr, SimConfig(device_rows=6, host_rows=0, policy=la, prefetch_depth=1))  # the prefetch path
    try:
        hits = simulate(tr, SimConfig(device_rows=6, host_rows=0, policy=la, prefetch_depth=0,
                                      **_ORACLE)).device_hits
    except Exception:  # noqa: BLE001 - refused at depth 0
        return 1
    return 0 if hits > lru else 1


#: the simulator's switch for lookahead at depth 0 (the trace is known), where it has one
_ORACLE = {"lookahead": True} if "lookahead" in inspect.signature(SimConfig).parameters else {}


# -- libCacheSim ---------------------------------------------------------------------------
def lcs_classes() -> list[type]:
    seen, out, todo = set(), [], list(lcs.CacheBase.__subclasses__())
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        out.append(c)
        todo.extend(c.__subclasses__())
    return sorted(out, key=lambda c: c.__name__)


#: the worker: runs the named algorithms one after the other on one oracleGeneral file,
#: a line before and after each (libCacheSim exits the process on some configurations,
#: e.g. FlashProb with a RAM part of 0 bytes; a worker dying costs only that run)
_WORKER = r"""
import json, sys, time
import libcachesim as lcs
f, n, cap, hp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for name in sys.argv[5:]:
    print("@@start " + name, flush=True)
    t0 = time.perf_counter()
    try:
        c = getattr(lcs, name)(cap, hashpower=hp)
        r, _ = c.process_trace(lcs.TraceReader(f, lcs.TraceType.ORACLE_GENERAL_TRACE))
        got = {"misses": round(r * n), "seconds": time.perf_counter() - t0}
    except Exception as e:
        got = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    print("@@done " + json.dumps([name, got]), flush=True)
"""


class LcsRunner:
    """Every libCacheSim algorithm (the subclasses of ``lcs.CacheBase``) over one
    oracleGeneral file, in a worker process.  A run that raises, or ends the worker, is
    recorded as failed (that trace and size only); an algorithm whose run takes over
    ``slow_s`` (or is killed at ``timeout_s``) is skipped from then on."""

    def __init__(self, slow_s: float, timeout_s: float):
        self.slow_s, self.timeout_s = slow_s, timeout_s
        self.skipped: dict[str, str] = {}
        self.failed: dict[str, list[str]] = {}
        self.names = []
        for c in lcs_classes():
            if c.__name__ == "PluginCache":
                self.skipped[c.__name__] = "needs Python hook functions (a framework, not an algorithm)"
            elif getattr(lcs, c.__name__, None) is not c:
                self.skipped[c.__name__] = "not exported by the libcachesim module"
            else:
                self.names.append(c.__name__)

    def run(self, f: Path, n: int, cap: int, hashpower: int, where: str) -> dict[str, dict]:
        """``name -> {"hit_rate", "misses", "seconds"}``."""
        out: dict[str, dict] = {}
        todo = [x for x in self.names if x not in self.skipped]
        while todo:
            todo = self._worker(f, n, cap, hashpower, todo, out, where)
        return out

    def _fail(self, name: str, where: str, why: str) -> None:
        self.failed.setdefault(name, []).append(f"{where}: {why}")

    def _worker(self, f, n, cap, hp, todo, out, where) -> list[str]:
        """Run ``todo`` in one worker; what is left when it dies or hangs."""
        import select
        import subprocess

        with tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen([sys.executable, "-c", _WORKER, str(f), str(n), str(cap), str(hp), *todo],
                                 stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
            cur, left, started = None, list(todo), time.perf_counter()
            try:
                while True:
                    ready, _, _ = select.select([p.stdout], [], [], 1.0)
                    if not ready:
                        if cur is not None and time.perf_counter() - started > self.timeout_s:
                            p.kill()
                            p.wait()
                            self.skipped[cur] = f"killed after {self.timeout_s:.0f} s on one run"
                            left.remove(cur)
                            return left
                        continue
                    line = p.stdout.readline()
                    if not line:  # the worker ended
                        p.wait()
                        err.seek(0)
                        tail = [t for t in (re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in err.read().splitlines())
                                if t]
                        why = f"ended the process (exit {p.returncode}): {(tail[-1] if tail else '')[-200:]}"
                        if cur is None:  # before any run (or after the last): nothing to retry
                            for name in left:
                                self._fail(name, where, why)
                            return []
                        self._fail(cur, where, why)
                        left.remove(cur)
                        return left
                    if line.startswith("@@start "):
                        cur, started = line[8:].strip(), time.perf_counter()
                    elif line.startswith("@@done "):
                        name, got = json.loads(line[7:])
                        left.remove(name)
                        cur = None
                        if "error" in got:
                            self._fail(name, where, got["error"])
                            continue
                        out[name] = {"hit_rate": 1 - got["misses"] / n, **got}
                        if got["seconds"] > self.slow_s:
                            self.skipped[name] = f"slow: {got['seconds']:.1f} s on one run (> {self.slow_s} s), skipped after it"
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()


# -- one trace -----------------------------------------------------------------------------
def bench_trace(tmp: Path, name: str, ids: np.ndarray, a, runner, la: dict, secs: dict) -> dict:
    n = ids.size
    distinct = int(ids.max()) + 1
    t0 = time.perf_counter()
    tr1 = one_table(tmp / f"{name}-1", ids, 1)
    one_table(tmp / f"{name}-{a.batch}", ids, a.batch)
    f = oracle_file(tmp / f"{name}.oracleGeneral", ids) if runner else None
    secs["traces"] += time.perf_counter() - t0
    hp = min(26, max(16, math.ceil(math.log2(distinct + 1)) + 1))
    out = {}
    for frac in SIZES:
        cap = max(1, int(distinct * frac))
        row: dict = {"cap": cap}
        t0 = time.perf_counter()
        hm, skipped = {}, {}
        for label, pol, params in project_variants(n):
            try:
                r = simulate(tr1, SimConfig(device_rows=cap, host_rows=0, policy=PolicySpec(pol, params)))
                hm[label] = r.hit_rate
                if label == "lru":
                    row["hiermem_lru_misses"] = r.device_misses
            except Exception as e:  # noqa: BLE001 - a policy that cannot run per access here
                skipped[label] = f"{type(e).__name__}: {str(e)[:160]}"
        row["hiermem"] = hm
        if skipped:
            row["hiermem_skipped"] = skipped
        secs["hiermem_per_access"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        row["belady"] = 1 - belady_misses(ids, cap) / n
        secs["belady"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        if runner:
            got = runner.run(f, n, cap, hp, f"{name} {frac:.0%}")
            row["libcachesim"] = {k: v["hit_rate"] for k, v in got.items()}
            row["libcachesim_seconds"] = {k: round(v["seconds"], 4) for k, v in got.items()}
            if "LRU" in got and "hiermem_lru_misses" in row:
                row["lru_equals_libcachesim"] = got["LRU"]["misses"] == row["hiermem_lru_misses"]
        else:
            row["libcachesim"] = None
        secs["libcachesim"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        if la["available"]:  # submitted to the workers (or run here: --jobs 1)
            row["lookahead"] = lookahead_part(tmp / f"{name}-{a.batch}", cap, a, la)
        secs["lookahead_wait"] += time.perf_counter() - t0
        out[f"{frac:.0%}"] = row
    return {"accesses": n, "distinct": distinct, "sizes": out}


def lookahead_spec(w: int, la: dict, base: str | None) -> PolicySpec:
    params = {"window": w}
    if la["base_param"] and base is not None:
        params["base"] = base
    return PolicySpec("lookahead", params)


def lookahead_run(path: str, cap: int, name: str, params: dict, depth: int) -> tuple:
    """``(hit rate or None, seconds, error or None)`` of one batch-granular run (in a
    worker process where ``--jobs`` > 1: the lookahead replay goes through Python per batch)."""
    t0 = time.perf_counter()
    try:
        r = simulate(path, SimConfig(device_rows=cap, host_rows=0, policy=PolicySpec(name, params),
                                     prefetch_depth=depth, **(_ORACLE if depth == 0 else {})))
        return r.hit_rate, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001 - e.g. a base the installed version lacks
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:160]}"


def lookahead_part(trb_path: Path, cap: int, a, la: dict) -> dict:
    """Lookahead's hit rate at each window (batches of ``a.batch``), and at window 16
    with each base where ``base`` is taken: submitted to ``la["pool"]`` (or run here),
    filled in by :func:`collect_lookahead`."""
    d = la["depth"]
    out: dict = {"hit_rate": {}, "labels": {}}

    def submit(into: dict, key: str, spec: PolicySpec, depth: int) -> None:
        args = (str(trb_path), cap, spec.name, dict(spec.params), depth)
        fut = la["pool"].submit(lookahead_run, *args) if la["pool"] else _Done(lookahead_run(*args))
        la["tasks"].append((into, key, fut))

    for w in a.windows:
        if w == 0 and d > 0:
            spec, depth, label = PolicySpec("lru"), 0, f"lru, batches of {a.batch} (no lookahead)"
        else:
            spec, depth = lookahead_spec(w, la, a.base), d
            label = f"lookahead window {w}, batches of {a.batch}, depth {d}" + (" (no lookahead)" if w == 0 else "")
        out["labels"][str(w)] = label
        submit(out["hit_rate"], str(w), spec, depth)
    if la["base_param"] and a.bases:
        out[f"w{TARGET_WINDOW}_by_base"] = by_base = {}
        for base in a.bases:
            submit(by_base, base, lookahead_spec(TARGET_WINDOW, la, base), d)
    return out


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def collect_lookahead(la: dict) -> float:
    """Fill in every submitted run (a failed run: its error in place of the rate, and
    in ``la["errors"]``); the seconds the runs took, summed."""
    total = 0.0
    for into, key, fut in la["tasks"]:
        rate, secs, err = fut.result()
        total += secs
        into[key] = rate if err is None else err
        if err is not None:
            la["errors"].append(f"{key}: {err}")
    la["tasks"].clear()
    return total


# -- summary -------------------------------------------------------------------------------
ADMISSION_SUFFIX = "+tinylfu"


def admission_off_on(res: dict) -> dict:
    """``trace -> size -> policy -> {"off", "tinylfu", "gain_pts"}``: each policy's hit rate
    without and with the admission filter (its default parameters)."""
    out: dict = {}
    for tname, t in res.items():
        for size, row in t.get("sizes", {}).items():
            hm = row["hiermem"]
            for label, on in hm.items():
                base = label[:-len(ADMISSION_SUFFIX)]
                if label.endswith(ADMISSION_SUFFIX) and base in hm:
                    out.setdefault(tname, {}).setdefault(size, {})[base] = {
                        "off": hm[base], "tinylfu": on, "gain_pts": 100 * (on - hm[base])}
    return out


def summarise(res: dict, la: dict) -> dict:
    gaps, ratios, curve, belady_ok, lru_eq = [], [], {}, True, []
    for tname, t in res.items():
        if "sizes" not in t:
            continue
        for size, row in t["sizes"].items():
            online = [v for v in row["hiermem"].values()]
            if row["belady"] < max(online, default=0) - 1e-12:
                belady_ok = False
            if row.get("libcachesim"):
                lon = {k: v for k, v in row["libcachesim"].items() if k not in LCS_ORACLES}
                if row["hiermem"] and lon:
                    hb = max(row["hiermem"], key=row["hiermem"].get)
                    lb = max(lon, key=lon.get)
                    gap = 100 * (row["hiermem"][hb] - lon[lb])
                    row["best_online"] = {"hiermem": hb, "hiermem_hit_rate": row["hiermem"][hb],
                                          "libcachesim": lb, "libcachesim_hit_rate": lon[lb], "gap_pts": gap}
                    gaps.append((gap, tname, size, hb, lb))
                if row["belady"] < max(lon.values(), default=0) - 1e-12:
                    belady_ok = False
            if "lru_equals_libcachesim" in row:
                lru_eq.append(row["lru_equals_libcachesim"])
            if "lookahead" in row:
                hr = {w: v for w, v in row["lookahead"]["hit_rate"].items() if isinstance(v, float)}
                curve.setdefault(tname, {})[size] = {w: (v / row["belady"] if row["belady"] else None)
                                                     for w, v in hr.items()}
                if str(TARGET_WINDOW) in hr and row["belady"]:
                    ratios.append((hr[str(TARGET_WINDOW)] / row["belady"], tname, size))
                if row["belady"] < max(hr.values(), default=0) - 1e-12:
                    belady_ok = False
    g = min(gaps) if gaps else None
    r = min(ratios) if ratios else None
    return {
        "worst_gap_to_libcachesim_pts": g[0] if g else None,
        "admission_off_on": admission_off_on(res),
        "worst_gap_at": {"trace": g[1], "size": g[2], "hiermem": g[3], "libcachesim": g[4]} if g else None,
        "gap_excludes": GAP_EXCLUDES,
        "worst_lookahead_over_belady": r[0] if r else None,
        "worst_lookahead_at": {"trace": r[1], "size": r[2], "window": TARGET_WINDOW} if r else None,
        "lookahead_window_curve": curve,
        "lru_equals_libcachesim": all(lru_eq) if lru_eq else None,
        "belady_bounds_every_policy": belady_ok,
        "targets_met": {"gap_to_libcachesim": (g[0] >= TARGET_GAP_PTS) if g else None,
                        "lookahead_over_belady": (r[0] >= TARGET_LOOKAHEAD) if r else None},
        "targets": {"worst_gap_to_libcachesim_pts": TARGET_GAP_PTS, "worst_lookahead_over_belady": TARGET_LOOKAHEAD},
    }


def print_tables(res: dict, la: dict) -> None:
    cols = [(t, s) for t, v in res.items() if "sizes" in v for s in v["sizes"]]
    if not cols:
        return
    head = [f"{t[:9]} {s}" for t, s in cols]
    rows: dict[str, list] = {}

    def put(label, i, v):
        rows.setdefault(label, [None] * len(cols))[i] = v

    for i, (t, s) in enumerate(cols):
        row = res[t]["sizes"][s]
        for k, v in row["hiermem"].items():
            put(f"hiermem {k}", i, v)
        put("hiermem belady (bound)", i, row["belady"])
        for k, v in (row["libcachesim"] or {}).items():
            put(f"lcs {k}" + (" (oracle)" if k in LCS_ORACLES else ""), i, v)
        if "lookahead" in row:
            w = str(TARGET_WINDOW)
            v = row["lookahead"]["hit_rate"].get(w)
            put(f"lookahead w={w} b={la['batch']} d={la['depth']}", i, v if isinstance(v, float) else None)
            for base, v in row["lookahead"].get(f"w{TARGET_WINDOW}_by_base", {}).items():
                put(f"lookahead w={w} base={base}", i, v if isinstance(v, float) else None)
    group = {"hiermem": 0, "lookahead": 1, "lcs": 2}
    rows = dict(sorted(rows.items(), key=lambda kv: (group[kv[0].split()[0]], "(oracle)" in kv[0] or "bound" in kv[0],
                                                     kv[0].lower())))
    print("\nhit rates, per access (%):")
    print(f"{'':<34}" + "".join(f"{h:>14}" for h in head))
    for label, vals in rows.items():
        print(f"{label:<34}" + "".join(f"{100 * v:>13.2f}%" if v is not None else f"{'-':>14}" for v in vals))
    if any("lookahead" in res[t]["sizes"][s] for t, s in cols):
        print(f"\nlookahead over Belady (per access), batches of {la['batch']}, prefetch depth {la['depth']}:")
        print(f"{'window':<34}" + "".join(f"{h:>14}" for h in head))
        for w in la["windows"]:
            vals = []
            for t, s in cols:
                row = res[t]["sizes"][s]
                hr = row.get("lookahead", {}).get("hit_rate", {}).get(str(w))
                vals.append(hr / row["belady"] if isinstance(hr, float) and row["belady"] else None)
            label = f"{w}" + (" (no lookahead)" if w == 0 else "")
            print(f"{label:<34}" + "".join(f"{v:>14.3f}" if v is not None else f"{'-':>14}" for v in vals))
    adm = admission_off_on(res)
    if adm:
        print("\nadmission filter (tinylfu) gain, points of hit rate:")
        pols = sorted({p for t in adm.values() for s in t.values() for p in s})
        print(f"{'':<34}" + "".join(f"{h:>14}" for h in head))
        for p in pols:
            vals = [adm.get(t, {}).get(s, {}).get(p, {}).get("gain_pts") for t, s in cols]
            print(f"{p:<34}" + "".join(f"{v:>+14.2f}" if v is not None else f"{'-':>14}" for v in vals))
    print()
    for t, s in cols:
        b = res[t]["sizes"][s].get("best_online")
        if b:
            print(f"best online {t} {s}: hiermem {b['hiermem']} {100 * b['hiermem_hit_rate']:.2f}% vs "
                  f"libCacheSim {b['libcachesim']} {100 * b['libcachesim_hit_rate']:.2f}%: {b['gap_pts']:+.2f} pts")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="< 120 s: 60k-access prefixes, Zipf 60k over 20k ids")
    mode.add_argument("--tiny", action="store_true", help="the smoke test's: 5k-access prefixes, Zipf 5k over 2k")
    ap.add_argument("--accesses", type=int, default=None,
                    help="prefix of each shared trace (0: whole; default by mode: tiny 5k, quick 60k, full whole)")
    ap.add_argument("--zipf-accesses", type=int, default=None, help="default by mode: 5k / 60k / 300k")
    ap.add_argument("--zipf-items", type=int, default=None, help="default by mode: 2k / 20k / 100k")
    ap.add_argument("--batch", type=int, default=10, help="accesses per batch of the lookahead runs")
    ap.add_argument("--windows", default=",".join(map(str, WINDOWS)), help="lookahead windows (batches)")
    ap.add_argument("--base", default="s3fifo", help="lookahead's base policy (passed only if Lookahead takes "
                    "it; default s3fifo: the best worst case of the bases measured, see docs/performance.md)")
    ap.add_argument("--bases", default=None, help="also run window 16 with each of these bases, where taken "
                    f"(default: none in --quick/--tiny, {','.join(LOOKAHEAD_BASES)} in full)")
    ap.add_argument("--lcs-slow", type=float, default=30.0, help="skip a libCacheSim algorithm after a run this long (s)")
    ap.add_argument("--lcs-timeout", type=float, default=120.0, help="kill a libCacheSim run after this long (s)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes for the lookahead runs (Python per batch; the rest runs here)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON to this file")
    a = ap.parse_args()
    m = "tiny" if a.tiny else "quick" if a.quick else "full"
    prefix, zn, zi = MODES[m]
    if a.accesses is not None:
        prefix = a.accesses or None
    zn = a.zipf_accesses or zn
    zi = a.zipf_items or zi
    a.windows = [int(w) for w in a.windows.split(",") if w.strip()]
    if TARGET_WINDOW not in a.windows:
        a.windows.append(TARGET_WINDOW)
    a.bases = [b for b in (a.bases if a.bases is not None else ("" if m != "full" else ",".join(LOOKAHEAD_BASES)))
               .split(",") if b]
    secs = {"startup": time.perf_counter() - _T0, "warm_up": 0.0, "traces": 0.0, "hiermem_per_access": 0.0,
            "libcachesim": 0.0, "belady": 0.0, "lookahead_wait": 0.0, "lookahead_runs": 0.0}

    runner = LcsRunner(a.lcs_slow, a.lcs_timeout) if lcs is not None else None
    if runner is None:
        print("libcachesim: not installed (pip install 'hiermem[peers]'): its figures are None")
    else:
        print(f"libcachesim {getattr(lcs, '__version__', '?')}: {len(runner.names)} algorithms "
              f"({', '.join(runner.names)})")
    print("hiermem policies: " + ", ".join(sorted(POLICIES)))

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        t0 = time.perf_counter()
        la_cls = POLICIES.get("lookahead")
        la = {"available": la_cls is not None, "batch": a.batch, "windows": a.windows,
              "depth": lookahead_depth(tmp) if la_cls is not None else None,
              "base_param": la_cls is not None and "base" in inspect.signature(la_cls.__init__).parameters,
              "pool": None, "tasks": [], "errors": []}
        secs["warm_up"] = time.perf_counter() - t0
        if la["available"] and a.jobs > 1:  # spawned after the warm-up: the workers load the compiled kernels
            import concurrent.futures
            import multiprocessing

            la["pool"] = concurrent.futures.ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn"))
        t0 = time.perf_counter()
        streams = load_streams(tmp, prefix, zn, zi)
        secs["traces"] += time.perf_counter() - t0
        if not la["available"]:
            print("lookahead: not in the registry; no lookahead figures")
        else:
            print(f"lookahead: prefetch depth {la['depth']} "
                  f"({'window independent of prefetch' if la['depth'] == 0 else 'acts only with prefetch: depth 1'}); "
                  f"base parameter: {'yes' if la['base_param'] else 'no'}"
                  + (f"; bases {a.bases} ignored" if a.bases and not la["base_param"] else ""))
        res = {}
        for name, (ids, note) in streams.items():
            if ids is None:
                print(f"{name}: {note}")
                res[name] = {"skipped": note}
                continue
            print(f"{name}: {note}, {int(ids.max()) + 1} distinct rows")
            res[name] = bench_trace(tmp, name, ids, a, runner, la, secs)
            res[name]["source"] = note
        t0 = time.perf_counter()
        secs["lookahead_runs"] += collect_lookahead(la)
        secs["lookahead_wait"] += time.perf_counter() - t0
        if la["pool"]:
            la["pool"].shutdown()
            la["pool"] = None
    out = {"mode": m, "prefix_accesses": prefix, "lookahead_batch": a.batch, "jobs": a.jobs,
           "lookahead_prefetch_depth": la["depth"], "lookahead_base_param": la["base_param"],
           "libcachesim_version": getattr(lcs, "__version__", None) if lcs else None,
           **summarise(res, la)}
    print_tables(res, la)
    if runner:
        print(f"sanity: hiermem lru misses == libCacheSim LRU misses on every trace and size: "
              f"{out['lru_equals_libcachesim']}")
        for k, why in runner.skipped.items():
            print(f"libcachesim {k}: skipped ({why})")
        for k, whys in runner.failed.items():
            print(f"libcachesim {k}: failed on {len(whys)} run(s): {whys[0]}")
    for err in la["errors"]:
        print(f"lookahead run failed: {err}")
    print(f"Belady bounds every policy: {out['belady_bounds_every_policy']}")
    g, r = out["worst_gap_to_libcachesim_pts"], out["worst_lookahead_over_belady"]
    if g is not None:
        w = out["worst_gap_at"]
        print(f"worst gap to libCacheSim (online, best vs best): {g:+.2f} pts at {w['trace']} {w['size']} "
              f"({w['hiermem']} vs {w['libcachesim']}); target >= {TARGET_GAP_PTS}: {out['targets_met']['gap_to_libcachesim']}")
    if r is not None:
        w = out["worst_lookahead_at"]
        print(f"worst lookahead (window {TARGET_WINDOW}, batches of {a.batch}) over Belady: {r:.3f} at "
              f"{w['trace']} {w['size']}; target >= {TARGET_LOOKAHEAD}: {out['targets_met']['lookahead_over_belady']}")
    secs["total"] = time.perf_counter() - _T0
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items())
          + f" (lookahead_runs: summed over {a.jobs} process(es); lookahead_wait: this process waiting for them)")
    out["seconds"] = {k: round(v, 3) for k, v in secs.items()}
    out["libcachesim_skipped"] = runner.skipped if runner else None
    out["libcachesim_failed"] = runner.failed if runner else None
    out["traces"] = {k: ({"source": v["source"], "accesses": v["accesses"], "distinct": v["distinct"]}
                         if "sizes" in v else v) for k, v in res.items()}
    out["tables"] = {k: v["sizes"] for k, v in res.items() if "sizes" in v}
    line = json.dumps(out)
    if a.json:
        a.json.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
