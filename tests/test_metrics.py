"""hiermem.observe.metrics: counter values by hand, the HTTP endpoint, scrapes during training,
and every dashboard expression evaluated by a real Prometheus server."""

from __future__ import annotations

import gc
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import hiermem as hm
from hiermem.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def make_store(path, device_rows=2, host_rows=2, tables=None, optimizer=None, write_combine=16384):
    tables = tables or [hm.TableSpec("t", 100, 4)]
    return hm.HierarchicalStore(tables, hm.StoreConfig(path=str(path), device="cpu", device_rows=device_rows,
                                                       host_rows=host_rows, policy="lru",
                                                       optimizer=optimizer or hm.SGD(lr=0.1), seed=0,
                                                       write_combine=write_combine))


def collector_registry(store, name="s"):
    stores = hm.MetricsRegistry()
    stores.add(store, name)
    reg = CollectorRegistry()
    reg.register(hm.StoreCollector(stores))
    return reg


def test_counters_after_a_scripted_sequence(tmp_path):
    """LRU, device 2 rows, host 2 rows, SGD rows of 4 floats (16 bytes)."""
    s = make_store(tmp_path / "s", write_combine=0)  # the write-back is its own LMDB transaction (counted)
    reg = collector_registry(s)
    t = lambda *ids: torch.tensor(ids)  # noqa: E731
    ids = t(0, 1, 0)
    s.lookup("t", ids)  # 2 distinct misses all the way down (created), 1 duplicate hit
    s.update("t", ids, torch.ones(3, 4))  # 0, 1 dirty
    s.lookup("t", t(2, 3))  # created; 0, 1 (dirty) go down to host
    s.lookup("t", t(4, 5))  # created; 2, 3 (clean) to host, 0, 1 (dirty) written to LMDB
    s.lookup("t", t(0, 2))  # 0 read from LMDB, 2 up from host; 4, 5 to host, 3 evicted (clean)

    def v(name, **labels):
        return reg.get_sample_value(name, {"store": "s", **labels})

    want = {  # tier: lookups, hits, misses, evictions, writebacks
        "device": (9, 1, 8, 6, 2),
        "host": (8, 1, 7, 3, 2),
        "disk": (7, 1, 6, 0, 0),
    }
    for tier, (lk, hit, miss, ev, wb) in want.items():
        lab = {"table": "t", "tier": tier}
        assert v("hiermem_lookups_total", **lab) == lk, tier
        assert v("hiermem_hits_total", **lab) == hit, tier
        assert v("hiermem_misses_total", **lab) == miss, tier
        assert v("hiermem_evictions_total", **lab) == ev, tier
        assert v("hiermem_writebacks_total", **lab) == wb, tier
    assert v("hiermem_host_to_device_bytes_total") == 8 * 16  # 6 created + 1 from LMDB + 1 from host
    assert v("hiermem_device_to_host_bytes_total") == 6 * 16
    assert v("hiermem_disk_to_host_bytes_total") == 1 * 16
    assert v("hiermem_host_to_disk_bytes_total") == 2 * 16
    assert v("hiermem_updates_total") == 1 and v("hiermem_updated_rows_total") == 2
    for name in ("hiermem_prefetched_rows_total", "hiermem_prefetch_hits_total", "hiermem_late_prefetches_total"):
        assert v(name) == 0
    for tier in ("device", "host"):
        assert v("hiermem_capacity_rows", tier=tier) == 2
        assert v("hiermem_capacity_bytes", tier=tier) == 32
        assert v("hiermem_occupancy_rows", tier=tier) == 2
        assert v("hiermem_occupancy_bytes", tier=tier) == 32
        assert v("hiermem_resident_rows", table="t", tier=tier) == 2
        assert v("hiermem_dirty_rows", tier=tier) == 0
        assert v("hiermem_pinned_rows", tier=tier) == 0
    assert v("hiermem_occupancy_rows", tier="disk") == 2  # rows 0 and 1
    assert v("hiermem_store_info", policy="lru") == 1
    assert v("hiermem_lookup_duration_seconds_count") == 4
    assert v("hiermem_update_duration_seconds_count") == 1
    assert v("hiermem_copy_duration_seconds_count") == 4  # every placement that moved rows (all four lookups)
    assert v("hiermem_lmdb_read_duration_seconds_count") == 4  # every lookup with rows off memory
    assert v("hiermem_lmdb_write_duration_seconds_count") == 2  # layout at creation, the write-back
    assert v("hiermem_lmdb_read_duration_seconds_bucket", le="+Inf") == 4
    s._host.pins[0] = 1  # pinned-row pressure comes from the tiers' pin counts
    assert v("hiermem_pinned_rows", tier="host") == 1
    s._host.pins[0] = 0
    s.update("t", t(4), torch.ones(1, 4))  # 4 comes up from host to be updated: one dirty row
    assert v("hiermem_dirty_rows", tier="device") == 1 and v("hiermem_dirty_rows", tier="host") == 0
    s.flush()
    assert v("hiermem_flushes_total") == 1 and v("hiermem_flushed_rows_total") == 1
    assert v("hiermem_dirty_rows", tier="device") == 0
    s.close()
    assert v("hiermem_lookups_total", table="t", tier="device") is None  # closed stores are not exported


def test_counters_match_stats_per_table_and_tier(tmp_path):
    tables = [hm.TableSpec("a", 1000, 8), hm.TableSpec("b", None, 4)]
    with make_store(tmp_path / "s", 50, 200, tables, hm.Adagrad(lr=0.1)) as s:
        reg = collector_registry(s)
        g = torch.Generator().manual_seed(0)
        for _ in range(20):
            for name, dim in (("a", 8), ("b", 4)):
                ids = torch.randint(0, 1000, (64,), generator=g)
                s.lookup(name, ids)
                s.update(name, ids, torch.randn(64, dim, generator=g))
        st = s.stats()
        for name in ("a", "b"):
            for tier in ("device", "host", "disk"):
                for stat in ("lookups", "hits", "misses", "evictions", "writebacks"):
                    assert reg.get_sample_value(f"hiermem_{stat}_total",
                                                {"store": "s", "table": name, "tier": tier}) == st[name][tier][stat]
                l, h = st[name][tier]["lookups"], st[name][tier]["hits"]
                assert h == l - st[name][tier]["misses"]
            assert st[name]["host"]["lookups"] == st[name]["device"]["misses"]
            assert st[name]["disk"]["lookups"] == st[name]["host"]["misses"]
        for io in ("bytes_host_to_device", "bytes_device_to_host", "bytes_disk_to_host", "bytes_host_to_disk"):
            a, b = io.split("_", 1)[1].split("_to_")
            assert reg.get_sample_value(f"hiermem_{a}_to_{b}_bytes_total", {"store": "s"}) == st["_store"][io]


def test_registry_names_and_weak_references(tmp_path):
    stores = hm.MetricsRegistry()
    a = make_store(tmp_path / "x" / "emb")
    b = make_store(tmp_path / "y" / "emb")
    assert stores.add(a) == "emb" and stores.add(b) == "emb-2" and stores.add(a) == "emb"
    assert any(st is a for _, st in hm.STORES.items())  # every store registers itself
    reg = CollectorRegistry()
    reg.register(hm.StoreCollector(stores))
    assert reg.get_sample_value("hiermem_store_info", {"store": "emb-2", "policy": "lru"}) == 1
    b.close()
    del b
    gc.collect()
    assert [n for n, _ in stores.items()] == ["emb"]
    stores.remove(a)
    assert stores.items() == []
    a.close()


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def test_serve_metrics_on_loopback(tmp_path):
    with make_store(tmp_path / "s") as s:
        stores = hm.MetricsRegistry()
        stores.add(s, "served")
        s.lookup("t", torch.tensor([1, 2, 1]))
        server, thread = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
        try:
            assert server.server_address[0] == "127.0.0.1"
            text = _get(f"http://127.0.0.1:{server.server_port}/metrics")
            assert 'hiermem_lookups_total{store="served",table="t",tier="device"} 3.0' in text
            assert "# TYPE hiermem_lmdb_read_duration_seconds histogram" in text
            names = set(re.findall(r"^(hiermem_\w+?)(?:_bucket|_count|_sum)?\{", text, re.M))
            assert all(re.fullmatch(r"hiermem_[a-z_]+", n) for n in names)
            labels = set(re.findall(r"[{,](\w+)=", text))
            assert labels <= {"store", "table", "tier", "policy", "le"}
        finally:
            server.shutdown()


def test_cli_serve_and_demo_metrics_port(tmp_path):
    path = tmp_path / "d"
    assert main(["demo", "--steps", "2", "--batch", "64", "--device-rows", "1024", "--host-rows", "4096",
                 "--path", str(path), "--metrics-port", "0", "--no-progress"]) == 0
    p = subprocess.Popen([sys.executable, "-m", "hiermem", "serve", str(path / "store"), "--port", "0",
                          "--seconds", "20"],
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        port = int(re.search(r"127\.0\.0\.1:(\d+)/metrics", line).group(1))
        text = _get(f"http://127.0.0.1:{port}/metrics")
        assert 'hiermem_occupancy_rows{store="store",tier="disk"}' in text
    finally:
        p.terminate()
        p.wait(10)


def test_prefetch_counters_after_a_scripted_sequence(tmp_path):
    """Device 4 rows, host 4 rows: prefetch, lookup with the ticket, release, by hand."""
    s = make_store(tmp_path / "p", 4, 4)
    reg = collector_registry(s)

    def v(name):
        return reg.get_sample_value(name, {"store": "s"})
    t = torch.zeros(3, dtype=torch.int64)
    ids = torch.tensor([1, 2, 1])
    tk = s.prefetch(t, ids)  # 2 distinct rows, new: placed on the device and pinned
    assert v("hiermem_prefetch_requests_total") == 1 and v("hiermem_prefetched_batches_total") == 1
    assert v("hiermem_prefetch_pinned_rows_total") == 2 and v("hiermem_prefetched_rows_total") == 2
    assert reg.get_sample_value("hiermem_lookups_total", {"store": "s", "table": "t", "tier": "device"}) == 3
    assert reg.get_sample_value("hiermem_pinned_rows", {"store": "s", "tier": "device"}) == 2
    s.lookup_bags(t, ids, torch.tensor([0, 2]), ticket=tk)  # served by the prefetch: not accounted again
    assert v("hiermem_prefetch_hits_total") == 3
    assert reg.get_sample_value("hiermem_lookups_total", {"store": "s", "table": "t", "tier": "device"}) == 3
    s.release(tk)
    assert reg.get_sample_value("hiermem_pinned_rows", {"store": "s", "tier": "device"}) == 0
    big = torch.arange(10, 15)  # 5 rows: 2 * 5 > 8 slots, refused by admission
    tk2 = s.prefetch(torch.zeros(5, dtype=torch.int64), big)
    assert not tk2.pinned and v("hiermem_prefetch_degraded_total") == 1 and v("hiermem_prefetch_requests_total") == 2
    assert v("hiermem_prefetched_batches_total") == 1 and v("hiermem_late_prefetches_total") == 0
    s.close()


# -- concurrency ----------------------------------------------------------------------------
def _train(path, steps, scrape_url=None, min_scrapes=0):
    """``steps`` training steps (more, up to 20x, until ``min_scrapes`` scrapes have
    happened); with ``scrape_url``, a thread scrapes the endpoint without pause."""
    tables = [hm.TableSpec("u", 5000, 16), hm.TableSpec("v", None, 8)]
    s = make_store(path, 200, 800, tables, hm.RowWiseAdagrad(lr=0.05))
    stores = hm.MetricsRegistry()
    stores.add(s, "train")
    server = None
    scrapes, stop = [0], threading.Event()
    if scrape_url:
        server, _ = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
        url = f"http://127.0.0.1:{server.server_port}/metrics"

        def scrape():
            while not stop.is_set():
                assert "hiermem_lookups_total" in _get(url)
                scrapes[0] += 1
        th = threading.Thread(target=scrape, daemon=True)
        th.start()
        while scrapes[0] < 3:
            time.sleep(0.005)
    g = torch.Generator().manual_seed(1)
    times = []
    try:
        while len(times) < steps or (scrapes[0] < min_scrapes and len(times) < 20 * steps):
            t0 = time.perf_counter()
            for name, dim, hi in (("u", 16, 5000), ("v", 8, 10**12)):
                ids = (torch.rand(256, generator=g) ** 3 * hi).long()
                rows = s.lookup(name, ids)
                s.update(name, ids, rows * 0.1 + torch.randn(256, dim, generator=g))
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        if server is not None:
            th.join(10)
            server.shutdown()
    final = torch.cat([s.lookup("u", torch.arange(i, min(i + 500, 5000))) for i in range(0, 5000, 500)])
    st = s.stats()
    s.close()
    return final, st, times, scrapes[0]


def test_scrapes_do_not_change_or_block_training(tmp_path):
    rows, st1, t1, n = _train(tmp_path / "b", 150, scrape_url=True, min_scrapes=200)
    assert n >= 200, f"only {n} scrapes in {len(t1)} steps"
    base, st0, t0, _ = _train(tmp_path / "a", len(t1))
    assert torch.equal(base, rows)
    st0["_store"].pop("disk_rows"), st1["_store"].pop("disk_rows")
    assert st0 == st1
    # a scrape holds the store lock only to copy counters: steps stay within a generous bound
    assert statistics.median(t1) <= 3 * statistics.median(t0) + 0.01, (statistics.median(t0), statistics.median(t1))


# -- the real Prometheus server ---------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def _prometheus_binary() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but the prometheus binary is missing (.ci/run installs the Debian package)")
        pytest.skip("prometheus binary not installed (apt-get install -y prometheus); CI runs this test")
    return exe


def _dashboard_exprs() -> list[tuple[str, str, str]]:
    """(panel title, unit, expr) for every target, Grafana variables substituted."""
    dash = json.loads((ROOT / "dashboards" / "hiermem.json").read_text())
    out = []
    for p in dash["panels"]:
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for t in p["targets"]:
            e = t["expr"].replace("$__rate_interval", "10s").replace("$store", ".*")
            assert "$" not in e, e
            out.append((p["title"], unit, e))
    return out


def test_dashboard_json_is_importable():
    dash = json.loads((ROOT / "dashboards" / "hiermem.json").read_text())
    assert dash["__inputs"][0]["name"] == "DS_PROMETHEUS"
    assert {v["name"] for v in dash["templating"]["list"]} >= {"DS_PROMETHEUS", "store"}
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"]
    assert len(_dashboard_exprs()) >= 20


def test_real_prometheus_evaluates_every_dashboard_expression(tmp_path):
    exe = _prometheus_binary()
    deadline = time.monotonic() + 55
    tables = [hm.TableSpec("user", 20000, 16), hm.TableSpec("item", None, 8)]
    s = make_store(tmp_path / "store", 300, 1500, tables, hm.RowWiseAdagrad(lr=0.05))
    stores = hm.MetricsRegistry()
    stores.add(s, "it")
    server, _ = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
    stop = threading.Event()

    def batches():
        g = torch.Generator().manual_seed(0)
        while not stop.is_set():
            lengths = torch.randint(0, 3, (2 * 128,), generator=g)
            hi = torch.tensor([20000] * 128 + [10**12] * 128).repeat_interleave(lengths)
            ids = (torch.rand(int(lengths.sum()), generator=g) ** 2 * hi).long()
            yield hm.SparseFeatures(("user", "item"), ids, lengths)
            time.sleep(0.01)

    def train():  # the module with a prefetch pipeline, so every prefetch metric moves too
        emb = hm.CachedEmbeddingBagCollection(tables, store=s)
        with hm.PrefetchPipeline(batches(), emb, depth=2) as pipe:
            for f in pipe:
                emb(f).square().mean().backward()
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    port = _free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                   f"  - job_name: hiermem\n    static_configs:\n      - targets: ['127.0.0.1:{server.server_port}']\n")
    log = open(tmp_path / "prometheus.log", "w")
    prom = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}"

    def query(expr: str) -> list:
        body = json.loads(_get(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def wait_for(cond, what):
        while time.monotonic() < deadline:
            try:
                if cond():
                    return
            except OSError:
                pass
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.25)
        pytest.fail(f"timed out waiting for {what}: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")

    def total_lookups() -> float:
        r = query('sum(hiermem_lookups_total{tier="device"})')
        return float(r[0]["value"][1]) if r else -1.0
    try:
        wait_for(lambda: _get(f"{api}/-/ready").strip() != "", "Prometheus to be ready")
        wait_for(lambda: (r := query('count_over_time(hiermem_store_info{store="it"}[1m])'))
                 and float(r[0]["value"][1]) >= 12, "12 scrapes")
        first = total_lookups()
        for title, unit, expr in _dashboard_exprs():
            res = query(expr)
            assert res, f"{title}: no data for {expr}"
            for r in res:
                v = float(r["value"][1])
                assert math.isfinite(v), f"{title}: {expr} = {v} {r['metric']}"
                if unit == "percentunit":
                    assert 0 <= v <= 1, f"{title}: {expr} = {v} {r['metric']}"
                else:
                    assert v >= 0, f"{title}: {expr} = {v}"
        hit = {r["metric"]["tier"]: float(r["value"][1]) for r in query(
            'sum by (tier) (rate(hiermem_hits_total[10s])) / sum by (tier) (rate(hiermem_lookups_total[10s]))')}
        assert set(hit) == {"device", "host", "disk"}
        wait_for(lambda: total_lookups() > first > 0, "counters to increase")
    finally:
        stop.set()
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()
        trainer.join(10)
        server.shutdown()
        s.close()


def test_disk_io_metrics_follow_the_store(tmp_path):
    """Read-ahead (the pipeline's), the writer's queue and I/O processes, writemap and
    reservoir rebuilds are exported as the store counts them."""
    tables = [hm.TableSpec("t", 50_000, 4)]
    s = hm.HierarchicalStore(tables, hm.StoreConfig(path=tmp_path / "s", device_rows=64, host_rows=256,
                                                    write_behind=True, optimizer=hm.SGD(lr=0.1)))
    emb = hm.CachedEmbeddingBagCollection(tables, store=s)
    reg = collector_registry(s)
    g = torch.Generator().manual_seed(0)

    def batches():
        for _ in range(12):
            yield hm.SparseFeatures(("t",), torch.randint(0, 600, (40,), generator=g), torch.full((10,), 4))
    try:
        with torch.no_grad():
            for f in batches():  # rows written to LMDB, to be read ahead below
                emb.store.update("t", f.values, torch.ones(40, 4))
        with hm.PrefetchPipeline(batches(), emb, depth=2) as it:
            for f in it:
                emb(f).sum().backward()
                # each step's background work done before the next: the read-ahead of a
                # batch then finishes before its prefetch (a fast step would otherwise beat
                # the I/O process's start, and no read-ahead would come in time to hit)
                it.wait_idle()
        st = s.stats()["_store"]

        def v(name, **labels):
            return reg.get_sample_value(name, {"store": "s", **labels})
        assert st["disk_read_ahead_rows"] > 0 and st["disk_read_ahead_hits"] > 0
        assert v("hiermem_disk_read_ahead_rows_total") == st["disk_read_ahead_rows"]
        assert v("hiermem_disk_read_ahead_hits_total") == st["disk_read_ahead_hits"]
        # the writer thread drains its queue on its own (nothing enqueues once the pipeline
        # is closed): the scrape sees a count between the stats read before and after it
        queue = v("hiermem_disk_write_queue_rows")
        assert s.stats()["_store"]["disk_write_queue_rows"] <= queue <= st["disk_write_queue_rows"]
        assert v("hiermem_disk_combined_rows") == st["disk_combined_rows"] == 0  # write-behind: none held
        # the I/O children start (and may stop) on their own threads: the scrape sees a
        # count between the stats read before and after it
        procs = v("hiermem_disk_io_processes")
        lo, hi = sorted((st["disk_io_processes"], s.stats()["_store"]["disk_io_processes"]))
        assert lo <= procs <= hi
        assert v("hiermem_disk_io_failures_total") == st["disk_io_failures"] == 0
        assert v("hiermem_disk_writemap") == int(st["disk_writemap"])
        for tier in ("device", "host"):
            assert v("hiermem_victim_reservoir_builds_total", tier=tier) == 0  # tiers this small are scanned
        s.flush()
        assert v("hiermem_disk_write_queue_rows") == 0 and v("hiermem_disk_combined_rows") == 0
    finally:
        s.close()


def test_combined_write_back_rows_are_exported(tmp_path):
    """Write-backs held for a combined commit (the default, ``write_combine``): the gauge
    follows the store's count, and drops to zero when a flush commits them."""
    s = make_store(tmp_path / "s", device_rows=8, host_rows=16)
    reg = collector_registry(s)
    try:
        for i in range(6):
            ids = torch.arange(10 * i, 10 * i + 10)
            s.update("t", ids, torch.ones(10, 4))  # dirty rows, evicted by the next batches
        held = s.stats()["_store"]["disk_combined_rows"]
        assert held > 0
        assert reg.get_sample_value("hiermem_disk_combined_rows", {"store": "s"}) == held
        s.flush()
        assert reg.get_sample_value("hiermem_disk_combined_rows", {"store": "s"}) == 0
    finally:
        s.close()
