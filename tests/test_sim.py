"""Trace format, recorder, importers, simulator semantics (prefetch, lookahead), the
bounds against references (cachetools, libcachesim, brute force), and the sim CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import cachetools
import numpy as np
import pytest
import torch

import hiermem as hm
from hiermem.cli.main import main as cli_main
from hiermem.errors import TraceFormatError
from hiermem.core.policies import POLICIES
from hiermem.sim import SimConfig, Simulator, TraceWriter, load_trace, simulate, write_trace
from hiermem.sim.bounds import belady_misses, lru_mrc
from hiermem.sim.engine import dense_rows
from hiermem.sim.datasets import import_criteo, import_movielens
from hiermem.nn.data import shared_data_dir

ROOT = Path(__file__).resolve().parent.parent
DATA = shared_data_dir()
needs_data = pytest.mark.skipif(DATA is None or not (DATA / "movielens-latest-small").is_dir()
                                or not (DATA / "criteo-dac-head8k").is_dir(), reason="shared data absent")


def _cachetools_hits(cls, cap, stream) -> int:
    c, hits = cls(cap), 0
    for x in stream:
        if x in c:
            c[x]
            hits += 1
        else:
            c[x] = True
    return hits


def _one_table(tmp_path, ids, batch, name="t"):
    ids = np.asarray(ids, dtype=np.int64)
    full, rest = divmod(ids.size, batch)
    lens = np.array([batch] * full + ([rest] if rest else []), dtype=np.int64).reshape(-1, 1)
    return load_trace(write_trace(tmp_path / name, ["t"], ids, lens))


# -- trace format -------------------------------------------------------------------------
def test_writer_streams_chunks_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    batches = [[rng.integers(0, 50, rng.integers(0, 30)), rng.integers(0, 9, rng.integers(0, 5))] for _ in range(200)]
    w = TraceWriter(tmp_path / "tr", ["a", "b"], chunk_accesses=300)
    peak = 0
    for b in batches:
        w.add(b)
        peak = max(peak, w._buffered)
    w.close()
    assert peak < 300  # bounded: a chunk is written as soon as 300 ids are buffered
    t = load_trace(tmp_path / "tr")
    assert len(list((tmp_path / "tr").glob("*.ids.npy"))) > 5
    assert t.tables == ("a", "b") and t.num_batches == 200
    for got, want in zip(t.batches(), batches):
        assert all(np.array_equal(g, x) for g, x in zip(got, want))
    with pytest.raises(hm.InvalidArgumentError):
        TraceWriter(tmp_path / "tr", ["a"])  # a trace is already there


def test_bad_traces_raise_typed_errors_naming_the_file(tmp_path):
    write_trace(tmp_path / "ok", ["t"], np.arange(10), np.array([[5], [5]]))
    with pytest.raises(TraceFormatError, match="manifest.json"):
        load_trace(tmp_path)  # a directory without a manifest
    (tmp_path / "f").write_text("x")
    with pytest.raises(TraceFormatError):
        load_trace(tmp_path / "f")
    mf = tmp_path / "ok" / "manifest.json"
    doc = json.loads(mf.read_text())
    mf.write_text("{not json")
    with pytest.raises(TraceFormatError, match="manifest.json"):
        load_trace(tmp_path / "ok")
    mf.write_text(json.dumps({**doc, "version": 99}))
    with pytest.raises(TraceFormatError, match="version"):
        load_trace(tmp_path / "ok")
    mf.write_text(json.dumps({**doc, "format": "something-else"}))
    with pytest.raises(TraceFormatError, match="not a hiermem trace"):
        load_trace(tmp_path / "ok")
    mf.write_text(json.dumps(doc))
    chunk = tmp_path / "ok" / doc["chunks"][0]["ids"]
    good = chunk.read_bytes()
    chunk.write_bytes(good[:-7])  # truncated
    with pytest.raises(TraceFormatError, match=chunk.name):
        load_trace(tmp_path / "ok")
    np.save(chunk, np.array([{"evil": 1}], dtype=object), allow_pickle=True)  # never unpickled
    with pytest.raises(TraceFormatError, match=chunk.name):
        load_trace(tmp_path / "ok")
    np.save(chunk, np.arange(9, dtype=np.int64))  # disagrees with the manifest
    with pytest.raises(TraceFormatError):
        load_trace(tmp_path / "ok")
    chunk.write_bytes(good)
    assert load_trace(tmp_path / "ok").accesses == 10


def test_recorder_splits_multi_table_batches_per_table(tmp_path):
    from hiermem.observe.trace import TraceRecorder
    from hiermem.store.placed import Batch

    t = torch.tensor([0, 1, 0, 2, 1])
    k = torch.tensor([5, 7, 9, 1, 3])
    inverse = torch.tensor([0, 2, 2, 1, 4, 3, 0])
    rec = TraceRecorder(tmp_path / "tr", ["a", "b", "c"])
    rec.record(Batch(t, k, inverse, torch.ones(5), torch.zeros(5), 7))
    rec.close()
    tr = load_trace(tmp_path / "tr")
    (a, b, c), = list(tr.batches())
    assert a.tolist() == [5, 9, 9, 5] and b.tolist() == [7, 3] and c.tolist() == [1]
    assert tr.ids.tolist() == [5, 9, 9, 7, 3, 1, 5] and tr.table_of_ids().tolist() == [0, 0, 0, 1, 1, 2, 0]


def test_store_record_api(tmp_path):
    store = hm.HierarchicalStore([hm.TableSpec("t", 100, 2)], hm.StoreConfig(path=tmp_path / "s"))
    assert store.stop_recording() is None
    store.record(tmp_path / "tr")
    with pytest.raises(hm.InvalidArgumentError, match="already recording"):
        store.record(tmp_path / "tr2")
    ids = torch.tensor([1, 2, 2, 3])
    store.lookup("t", ids)
    store.update("t", ids, torch.zeros(4, 2))  # updates are not lookups: not recorded
    store.lookup_pooled("t", ids, torch.tensor([0, 2]))
    assert store.stop_recording() == tmp_path / "tr"
    store.lookup("t", ids)  # not recorded any more
    store.close()
    tr = load_trace(tmp_path / "tr")
    assert tr.num_batches == 2 and tr.ids.tolist() == [1, 2, 2, 3] * 2
    with pytest.raises(hm.InvalidTypeError):
        hm.StoreConfig(path=tmp_path / "x", trace_path=3)


# -- simulator semantics -------------------------------------------------------------------------
def test_batch_size_one_equals_cachetools_lru_and_lfu(tmp_path):
    stream = np.random.default_rng(1).zipf(1.2, 1500) % 500
    tr = _one_table(tmp_path, stream, 1)
    for name, cls in (("lru", cachetools.LRUCache), ("lfu", cachetools.LFUCache)):
        for cap in (8, 64):
            r = simulate(tr, SimConfig(device_rows=cap, policy=name))
            assert r.device_hits == _cachetools_hits(cls, cap, stream.tolist()), (name, cap)


def test_prefetch_invariants(tmp_path):
    """Depth k: every access accounted once, pinned slots never victims, pins released,
    and with room for k+1 batches nothing is degraded."""
    rng = np.random.default_rng(2)
    tr = _one_table(tmp_path, rng.zipf(1.1, 6000) % 2000, 50)
    for policy in ("lru", "lfu", "lookahead"):
        for depth, dev, host in ((1, 200, 300), (3, 400, 600), (2, 60, 60)):
            sim = Simulator(tr, SimConfig(device_rows=dev, host_rows=host, policy=policy, prefetch_depth=depth))
            orig = sim._resolve

            def checked(*args, orig=orig, sim=sim, **kw):
                # pinned rows before the placement must all be resident after it
                held = [(t.keys_t[t.pins > 0].clone(), t.keys_k[t.pins > 0].clone()) for t in (sim._dev, sim._host)]
                out = orig(*args, **kw)
                for kt, kk in held:
                    assert bool((sim._keys.find(kt, kk) >= 0).all()), "a pinned row was picked as a victim"
                return out
            sim._resolve = checked
            r = sim.run()
            assert r.tier(hm.Tier.DEVICE)["lookups"] == tr.accesses
            pins = int(sim._dev.pins.abs().sum()) + int(sim._host.pins.abs().sum())
            assert sim._pinned_rows == 0 and pins == 0
            if dev >= 50 * (depth + 1):
                assert r.degraded == 0
            else:
                assert r.degraded > 0  # tiers too small for 3 pinned batches of 50: degraded, still accounted


def test_prefetch_degraded_and_capacity_error(tmp_path):
    tr = _one_table(tmp_path, np.arange(400) % 97, 40)
    with pytest.raises(hm.CapacityError):
        simulate(tr, SimConfig(device_rows=10, host_rows=10))  # 40 distinct rows, 20 slots
    r = simulate(tr, SimConfig(device_rows=30, host_rows=30, prefetch_depth=1))
    assert r.degraded > 0 and r.tier(hm.Tier.DEVICE)["lookups"] == 400


def test_lookahead_direct_calls_and_oracle_gain(tmp_path):
    p = POLICIES["lookahead"](6, "cpu")
    p.on_insert(torch.arange(6), torch.arange(6), torch.ones(6, dtype=torch.int64))
    p.on_lookahead(torch.tensor([0, 1]))
    assert sorted(p.victims(4, torch.ones(6, dtype=torch.bool)).tolist()) == [2, 3, 4, 5]
    p.on_lookahead(torch.tensor([4]))  # replaces the previous set
    assert p.victims(5, torch.ones(6, dtype=torch.bool)).tolist() == [0, 1, 2, 3, 5]
    # a cycle one longer than the cache: LRU misses every access, lookahead keeps most
    tr = _one_table(tmp_path, np.tile(np.arange(9), 60), 1)
    lru = simulate(tr, SimConfig(device_rows=8, policy="lru"))
    spec = hm.PolicySpec("lookahead", {"window": 4})
    la = simulate(tr, SimConfig(device_rows=8, host_rows=2, policy=spec, prefetch_depth=1))
    lru1 = simulate(tr, SimConfig(device_rows=8, host_rows=2, policy="lru", prefetch_depth=1))
    assert lru.device_hits == 0 and lru1.device_hits == 0 and la.device_hits > 0.5 * tr.accesses
    # no pipeline (depth 0): no future ids, exactly LRU
    assert simulate(tr, SimConfig(device_rows=8, policy=spec)).device_hits == 0
    assert belady_misses(tr.ids, 8) <= la.device_misses


def test_lfu_decay_limits():
    """A huge half-life orders like LFU, a tiny one like LRU."""
    rng = np.random.default_rng(3)
    acc = [(int(rng.integers(0, 12)), c) for c in range(12, 200)]
    pols = {n: POLICIES[n](12, "cpu") for n in ("lfu", "lru")}
    pols["slow"] = POLICIES["lfu_decay"](12, "cpu", half_life=1e12)
    pols["fast"] = POLICIES["lfu_decay"](12, "cpu", half_life=1e-3)
    one = torch.ones(1, dtype=torch.int64)
    for p in pols.values():
        p.on_insert(torch.arange(12), torch.arange(12), torch.ones(12, dtype=torch.int64))
        for s, c in acc:
            p.on_access(torch.tensor([s]), torch.tensor([c]), one)
    ev = torch.ones(12, dtype=torch.bool)
    order = {n: p.victims(12, ev).tolist() for n, p in pols.items()}
    counts = pols["lfu"].key >> 40
    assert counts[order["slow"]].tolist() == sorted(counts.tolist())  # least used first (ties: mean age)
    assert order["fast"] == order["lru"]
    with pytest.raises(hm.PolicyFileError):
        hm.resolve_policy(_tmp_policy('name = "lfu_decay"\n[params]\nhalf_life = -1.0\n'))


def _tmp_policy(text: str) -> Path:
    import tempfile

    f = Path(tempfile.mkdtemp()) / "p.toml"
    f.write_text(text)
    return f


# -- bounds -------------------------------------------------------------------------------
def _brute_opt(trace, cap) -> int:
    best = [len(trace) + 1]

    def go(i, cache, m):
        if m >= best[0]:
            return
        if i == len(trace):
            best[0] = m
            return
        x = trace[i]
        if x in cache:
            go(i + 1, cache, m)
        elif len(cache) < cap:
            go(i + 1, cache | {x}, m + 1)
        else:
            for y in cache:
                go(i + 1, (cache - {y}) | {x}, m + 1)
    go(0, frozenset(), 0)
    return best[0]


def test_belady_equals_brute_force_on_tiny_traces():
    rng = np.random.default_rng(4)
    for _ in range(40):
        tr = rng.integers(0, 6, int(rng.integers(1, 15)))
        cap = int(rng.integers(1, 4))
        assert belady_misses(tr, cap) == _brute_opt(tr.tolist(), cap)


def _oracle_file(path: Path, ids: np.ndarray) -> Path:
    from hiermem.sim.bounds import dense_ids, next_use

    d = dense_ids(ids)
    nxt = next_use(d)
    rec = np.zeros(ids.size, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("sz", "<u4"), ("nx", "<i8")]))
    rec["t"] = np.arange(ids.size)
    rec["id"] = d + 1
    rec["sz"] = 1
    rec["nx"] = np.where(nxt < ids.size, nxt, -1)
    rec.tofile(path)
    return path


@needs_data
def test_movielens_lru_sim_equals_cachetools_and_libcachesim(tmp_path, capsys):
    lcs = pytest.importorskip("libcachesim")
    ml = np.load(DATA / "movielens-latest-small" / "items_by_time.npy", allow_pickle=False).astype(np.int64)
    distinct = np.unique(ml).size
    mrc = lru_mrc(ml)
    f = _oracle_file(tmp_path / "ml.oracleGeneral", ml)
    prefix = _one_table(tmp_path, ml[:3000], 1)
    report = {}
    for frac in (0.01, 0.05, 0.10):
        cap = int(distinct * frac)
        ref = ml.size - _cachetools_hits(cachetools.LRUCache, cap, ml.tolist())
        ratio, _ = lcs.LRU(cap, hashpower=21).process_trace(lcs.TraceReader(str(f), lcs.TraceType.ORACLE_GENERAL_TRACE))
        assert mrc.misses(cap) == ref == round(ratio * ml.size), cap
        # the batch simulator itself, per access (batch size 1), on a prefix
        pre = ml[:3000].tolist()
        assert simulate(prefix, SimConfig(device_rows=cap, policy="lru")).device_misses == \
            3000 - _cachetools_hits(cachetools.LRUCache, cap, pre)
        lfu_ref = ml.size - _cachetools_hits(cachetools.LFUCache, cap, ml.tolist())
        report[cap] = {"lru": ref, "belady": belady_misses(ml, cap), "cachetools_lfu": lfu_ref}
        for name in ("LFU", "Belady"):
            r, _ = getattr(lcs, name)(cap, hashpower=21).process_trace(
                lcs.TraceReader(str(f), lcs.TraceType.ORACLE_GENERAL_TRACE))
            report[cap][f"libcachesim_{name.lower()}"] = round(r * ml.size)
    with capsys.disabled():
        print("\nmovielens misses (ours vs libcachesim):", json.dumps(report))
    for cap, r in report.items():
        assert r["belady"] <= r["libcachesim_belady"] and r["belady"] <= r["lru"]


@needs_data
def test_belady_bounds_every_policy_on_shared_traces(tmp_path):
    """Batches fit the device (96 ratings, 12 Criteo samples = at most 312 ids <= 1% of 34k)."""
    traces = [import_movielens(tmp_path / "ml", batch_size=96), import_criteo(tmp_path / "cr", batch_size=12)]
    runs = [(name, 0) for name in sorted(POLICIES) if name != "lookahead"] + [("lookahead", 1)]
    for path, fracs in zip(traces, ((0.01, 0.05), (0.01,))):
        tr = load_trace(path)
        dense = dense_rows(tr)[0]
        distinct = int(dense.max()) + 1
        for frac in fracs:
            cap = int(distinct * frac)
            bound = belady_misses(dense, cap)
            for name, depth in runs:
                r = simulate(tr, SimConfig(device_rows=cap, host_rows=cap, policy=name, prefetch_depth=depth))
                assert bound <= r.device_misses, (path.name, cap, name, depth)


# -- CLI ------------------------------------------------------------------------------------
def test_cli_import_npy_and_sim_json_match_cachetools(tmp_path, capsys):
    stream = (np.random.default_rng(5).zipf(1.3, 3000) % 400).astype(np.int64)
    np.save(tmp_path / "ids.npy", stream)
    assert cli_main(["trace", "import", "npy", str(tmp_path / "ids.npy"), str(tmp_path / "tr"),
                     "--table", "t", "--batch-size", "1"]) == 0
    capsys.readouterr()
    out = {}
    for p in ("lru", "lfu", "belady"):
        assert cli_main(["sim", str(tmp_path / "tr"), "--policy", p, "--device-rows", "40", "--json"]) == 0
        out[p] = json.loads(capsys.readouterr().out)
        assert out[p]["accesses"] == 3000
        assert out[p]["device"]["hits"] + out[p]["device"]["misses"] == 3000
    assert out["lru"]["device"]["hits"] == _cachetools_hits(cachetools.LRUCache, 40, stream.tolist())
    assert out["lfu"]["device"]["hits"] == _cachetools_hits(cachetools.LFUCache, 40, stream.tolist())
    assert out["belady"]["device"]["hits"] >= max(out["lru"]["device"]["hits"], out["lfu"]["device"]["hits"])
    assert cli_main(["sim", str(tmp_path), "--policy", "lru", "--device-rows", "4"]) == 2  # not a trace
    assert "manifest.json" in capsys.readouterr().err


def test_cli_entry_point_runs(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.int64) % 7)
    assert cli_main(["trace", "import", "npy", str(tmp_path / "ids.npy"), str(tmp_path / "tr"),
                     "--table", "x", "--batch-size", "10"]) == 0
    r = subprocess.run([sys.executable, "-m", "hiermem", "sim", str(tmp_path / "tr"), "--policy", "lfu",
                        "--device-rows", "7", "--prefetch-depth", "1", "--json"], check=True, cwd=ROOT,
                       capture_output=True, text=True)
    d = json.loads(r.stdout)
    assert d["accesses"] == 100 and d["device"]["misses"] == 7


def _counts(r) -> tuple:
    return r.counters.table.tolist(), r.counters.io.tolist()


def test_empty_batches_before_a_multi_id_batch_are_skipped_not_misreplayed(tmp_path):
    """An empty batch followed by one of several ids: that batch is deduplicated and
    placed (the compiled replay once placed nothing for it)."""
    ids = np.array([1, 2, 3, 4, 5, 1, 2], dtype=np.int64)
    plain = simulate(write_trace(tmp_path / "a", ["z"], ids, np.array([[5], [2]])), SimConfig(3, 10))
    for lens in ([[0], [5], [2]], [[0], [0], [5], [0], [2]], [[5], [0], [2], [0]]):
        r = simulate(write_trace(tmp_path / str(len(lens)), ["z"], ids, np.array(lens)), SimConfig(3, 10))
        assert int(r.counters.table[0, 0, 0]) == 7
        assert _counts(r) == _counts(plain)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pipelined_replay_equals_the_single_loop(tmp_path, policy):
    """The dedup a batch ahead on a second thread changes no number: large, single-id and
    empty batches mixed, with updates, pinned-free tiers that spill to disk."""
    rng = np.random.default_rng(7)
    lens = rng.choice([0, 1, 1, 3, 600], 300)
    ids = (rng.zipf(1.2, int(lens.sum())) % 5000).astype(np.int64)
    path = write_trace(tmp_path / "t", ["z"], ids, lens.reshape(-1, 1), updates=True)
    one = simulate(path, SimConfig(200, 800, policy=policy, pipeline=False))
    two = simulate(path, SimConfig(200, 800, policy=policy, pipeline=True))
    assert _counts(one) == _counts(two)
    assert one.counters.table[0, 2, 0] > 0  # rows went to disk and came back


def test_ids_kept_as_rows_or_ranked_give_the_same_numbers(tmp_path):
    """Ids within [0, accesses) are their own row numbers (no ranking pass); shifted far
    out they are ranked: the same counters either way."""
    rng = np.random.default_rng(3)
    ids = (rng.zipf(1.1, 20_000) % 3000).astype(np.int64)
    lens = np.full((40, 1), 500)
    near = simulate(write_trace(tmp_path / "n", ["z"], ids, lens), SimConfig(100, 400, policy="lfu"))
    far = simulate(write_trace(tmp_path / "f", ["z"], ids + 10**12, lens), SimConfig(100, 400, policy="lfu"))
    assert _counts(near) == _counts(far)
    assert dense_rows(load_trace(tmp_path / "n"), keep_ids=True)[0].tolist() == ids.tolist()


def test_a_failing_dedup_thread_raises_on_the_caller_and_stops(tmp_path, monkeypatch):
    """The two-thread replay: an error on the dedup thread is raised by simulate, and
    the thread is gone afterwards (none left waiting on a buffer)."""
    import threading

    from hiermem.core import replay as replay_mod

    ids = (np.random.default_rng(2).zipf(1.2, 6000) % 900).astype(np.int64)
    path = write_trace(tmp_path / "t", ["z"], ids, np.full((10, 1), 600))
    real, calls = replay_mod.dedup_batch, []

    def failing(*a):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("dedup failed")
        return real(*a)

    monkeypatch.setattr(replay_mod, "dedup_batch", failing)
    with pytest.raises(RuntimeError, match="dedup failed"):
        simulate(path, SimConfig(100, 300, pipeline=True))
    assert not any(t.name == "hiermem-replay-dedup" for t in threading.enumerate())
