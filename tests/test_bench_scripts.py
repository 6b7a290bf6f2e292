"""The benchmark scripts' pure helpers: Criteo sizing and skew, ratio bookkeeping, the
LMDB per-row comparison (the scripts themselves are run by hand; see the README)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"hm_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bt():
    return _load("bench_train")


@pytest.mark.parametrize("n", [100, 5_000, 200_000])
def test_alpha_puts_ninety_percent_on_the_top_one_percent(bt, n):
    assert bt.top_share(n, bt.alpha_for_share(n)) == pytest.approx(0.9, abs=1e-3)


def test_criteo_workload_follows_the_kaggle_cardinalities(bt):
    wl = bt.criteo_workload(1_000_000, 16)
    rows = np.array([t.num_rows for t in wl.tables])
    card = np.array(bt.CRITEO_KAGGLE)
    assert len(rows) == 26 and sum(card) == 33_762_577
    assert abs(rows.sum() - 1_000_000) < 2_000
    big = card > 100_000
    np.testing.assert_allclose(rows[big] / rows[big].sum(), card[big] / card[big].sum(), rtol=1e-3)
    assert (rows >= np.minimum(card, 100)).all()
    ranks = wl.samplers[2].ranks(50_000)  # rank 0 is the hottest row
    assert (ranks < round(rows[2] / 100)).mean() == pytest.approx(0.9, abs=0.01)


def test_worst_ratio_pairs_each_configuration_with_its_counterpart(bt):
    res = {"w/disk@1W": {"over_baseline": 0.5}, "w/disk_pf@1W": {"over_baseline": 0.4},
           "w/disk@2W": {"over_baseline": 0.5}, "w/disk_pf@2W": {"over_baseline": 0.6},
           "w/disk_wb@2W": {"over_baseline": 0.25}, "w/disk_pf_wb@2W": {"over_baseline": 0.3}}
    assert bt.worst(res, (("disk_pf", "disk"),)) == pytest.approx(0.8)
    assert bt.worst(res, (("disk_wb", "disk"), ("disk_pf_wb", "disk_pf"))) == pytest.approx(0.5)
    assert bt.worst({}, (("disk_pf", "disk"),)) is None


def test_bench_io_per_row_costs_compare_the_same_rows(tmp_path):
    io = _load("bench_io")
    out = io.per_row_costs(tmp_path / "lmdb", 8_000, 2_000, 2)
    assert out["rows_per_step"] > 1_000
    for op in ("read", "write"):
        assert out[f"{op}_store_us_per_row"] > 0 and out[f"{op}_raw_us_per_row"] > 0
        assert out[f"{op}_store_over_raw"] > 0


def test_paired_runs_both_configurations_on_the_same_batches(bt, tmp_path):
    """The never-hurts ratios come from a pair trained on the same batches in alternating
    blocks: one ratio per block, each configuration's resolved modes reported."""
    import types

    import torch

    wl = bt.zipf_workload(1.05, 3_000, 8, 2)
    a = types.SimpleNamespace(warmup_cap=bt.MIN_WARMUP, steps=10, device="cpu", dim=8, batch=32)
    batches = bt.make_batches(wl, a.warmup_cap + bt.PAIR_STEPS * a.steps + bt.DEPTH + 8, a.batch)
    ck = bt.template(wl, bt.PlainEmbeddingBags(wl.tables), tmp_path)
    ctx = {"args": a, "batches": batches, "tmp": tmp_path, "ck": ck}
    torch.manual_seed(0)
    out = bt.paired(ctx, wl, "zipf/prefetch@1W", (64, 512, bt.DEPTH, False), (64, 512, 0, False))
    assert len(out["block_ratios"]) == bt.PAIR_STEPS * a.steps // bt.BLOCK
    assert out["ratio"] == pytest.approx(float(np.median(out["block_ratios"])), abs=1e-4)  # blocks rounded
    assert out["a"][0] in ("threads", "inline", "foreground") and out["b"] == (None, False)
    assert not list(tmp_path.glob("*-pair-*"))  # both stores removed


def test_lmdb_bound_from_a_configurations_figures(bt):
    """The LMDB bound: the baseline's step with the configuration's LMDB time added
    (serial) or hidden on another core (overlapped)."""
    c = {"baseline_samples_per_s": 256 / 2e-3, "ms_per_step": {"lmdb_read": 1.0, "lmdb_write": 3.0}}
    b = bt.bound(c, 256)
    assert b["baseline_ms"] == pytest.approx(2.0) and b["lmdb_ms"] == pytest.approx(4.0)
    assert b["serial"] == pytest.approx(2 / 6, abs=1e-3) and b["overlapped"] == pytest.approx(0.5)
    c["ms_per_step"] = {"lmdb_read": 0.5, "lmdb_write": 0.5}
    assert bt.bound(c, 256)["overlapped"] == pytest.approx(1.0)


def test_the_replay_floor_is_an_exact_lru():
    """bench_sim's (and bench_core's) same-run floor, a bare numba LRU, counts the hits
    cachetools' LRUCache counts on the same ids (the ratio compares equal work)."""
    from cachetools import LRUCache

    bs = _load("bench_sim")
    rng = np.random.default_rng(4)
    ids = (rng.zipf(1.3, 20_000) % 500).astype(np.int64)
    for cap in (1, 7, 64, 499, 600):
        c, hits = LRUCache(cap), 0
        for i in ids.tolist():
            if i in c:
                hits += 1
                c[i]  # a use: most recent
            else:
                c[i] = True
        assert bs._floor_lru(ids, 500, cap) == hits


def test_bench_lmdb_native_runs_the_same_steps_in_c_and_py_lmdb(tmp_path):
    """The steps file the C loop reads holds each step's (table, id) pairs, sorted and
    distinct; where the C loop builds (cc and liblmdb-dev), both loops run every step on
    the environment it fills, else the script names what is missing."""
    nat = _load("bench_lmdb_native")
    steps = nat.draw_steps(np.random.default_rng(3), 3, 500, 100, 4)
    nat.write_ids(tmp_path / "ids", steps)
    raw = np.fromfile(tmp_path / "ids", dtype="<i8")
    assert raw[0] == 4
    at = 1
    for step in steps:
        n = int(raw[at])
        pairs = raw[at + 1:at + 1 + 2 * n].reshape(n, 2)
        at += 1 + 2 * n
        assert n == 100 and len({tuple(p) for p in pairs.tolist()}) == n
        assert pairs.tolist() == sorted(pairs.tolist()) and pairs[:, 1].max() < 500
        assert [t for t, _ in step] == sorted(set(pairs[:, 0].tolist()))
    assert at == raw.size
    exe, why = nat.build(tmp_path)
    if exe is None:
        assert why
        return
    env = tmp_path / "env"
    env.mkdir()
    import subprocess

    subprocess.run([str(exe), "fill", str(env), "3", "500", "64"], check=True)
    c = nat.native(exe, env, 3, 64, tmp_path / "ids", tmp_path / "times")
    py = nat.py_lmdb(env, 3, 64, steps)
    assert c.shape == py.shape == (4, 2) and (c > 0).all() and (py > 0).all()


@pytest.mark.slow
def test_bench_pipeline_runs_small_and_reports_every_figure(tmp_path):
    """A tiny bench_pipeline run: one JSON line with the issue's figures (timings are not
    checked here: benchmarks are run by hand)."""
    import json
    import subprocess

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--quick", "--rows", "20000",
                        "--criteo-rows", "60000", "--batch", "64", "--steps", "10", "--warmup-cap", "40",
                        "--dense-ms", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d == json.loads(out.read_text())
    for k in ("host_over_baseline", "disk_prefetch_over_baseline", "criteo_disk_prefetch_over_baseline",
              "device_over_baseline", "critical_path_share_host"):
        assert isinstance(d[k], float) and d[k] > 0, k
    host = d["configs"]["zipf1.05/host"]
    assert host["prefetch_mode"] == "threads" and host["rows_per_step"]["host_to_device"] > 0
    assert d["configs"]["criteo/disk"]["combine_cycles"] >= 0 and 0 < d["gil_free_during_wait"]


def test_bench_fbgemm_cache_skips_cleanly_without_cuda():
    import json
    import subprocess

    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: gpu_check.sh runs it for real")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_fbgemm_cache.py"), "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout.strip().splitlines()[-1]) == {"skipped": "needs CUDA"}


@pytest.mark.slow
def test_bench_policy_tiny_reports_every_table_and_belady_bounds_them(tmp_path):
    """bench_policy --tiny: the issue's JSON keys and shapes, every hit rate in [0, 1],
    Belady per access at or above every online policy (and lookahead), hiermem's LRU
    equal to libCacheSim's where it is installed (targets are not checked here)."""
    import json
    import subprocess

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_policy.py"), "--tiny", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d == json.loads(out.read_text())
    for k in ("worst_gap_to_libcachesim_pts", "gap_excludes", "worst_lookahead_over_belady", "lookahead_window_curve",
              "tables", "targets_met", "seconds", "lru_equals_libcachesim", "libcachesim_skipped"):
        assert k in d, k
    assert set(d["targets_met"]) == {"gap_to_libcachesim", "lookahead_over_belady"}
    assert "zipf1.05" in d["tables"]  # the shared traces are skipped where the data is absent
    has_lcs = d["libcachesim_version"] is not None
    gaps, ratios = [], []
    for trace, sizes in d["tables"].items():
        assert set(sizes) == {"2%", "10%"}
        for size, row in sizes.items():
            assert 0 <= row["belady"] <= 1 and "lru" in row["hiermem"]
            online = list(row["hiermem"].values())
            if has_lcs:
                assert row["libcachesim"]["LRU"] == pytest.approx(row["hiermem"]["lru"], abs=1e-12)
                online += [v for k, v in row["libcachesim"].items() if k not in ("Belady", "BeladySize")]
                gaps.append(row["best_online"]["gap_pts"])
            la = row["lookahead"]["hit_rate"]
            assert sorted(la, key=int) == ["0", "1", "2", "4", "8", "16", "32", "64"]
            online += list(la.values())
            assert all(isinstance(v, float) and 0 <= v <= 1 for v in online), (trace, size)
            assert row["belady"] >= max(online) - 1e-12, (trace, size)
            curve = d["lookahead_window_curve"][trace][size]
            assert curve["16"] == pytest.approx(la["16"] / row["belady"])
            ratios.append(curve["16"])
    assert d["worst_lookahead_over_belady"] == pytest.approx(min(ratios))
    assert d["belady_bounds_every_policy"] is True
    if has_lcs:
        assert d["lru_equals_libcachesim"] is True
        assert d["worst_gap_to_libcachesim_pts"] == pytest.approx(min(gaps))
        assert isinstance(d["targets_met"]["gap_to_libcachesim"], bool)
    else:
        assert d["worst_gap_to_libcachesim_pts"] is None
