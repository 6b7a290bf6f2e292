"""Step time with metrics on vs off, interleaved in one run.

One store (1% device, 10% host, LMDB; Zipf ids, lookup + fused row-wise Adagrad update
on two tables) trains in rounds; each round runs ``--steps`` steps with metrics *off*
(no server, no scrapes) and ``--steps`` with metrics *on* (the store registered with a
``StoreCollector``, ``serve_metrics`` running and a background thread scraping
``/metrics`` over HTTP every ``--interval`` s, with a bare socket client), the order alternating per round.  The
store's plain counters and duration histograms are always bumped (they are part of the
store); "on" adds what exporting costs.  The last line is JSON:
``metrics_overhead`` = total step time on / off.

    python scripts/bench_metrics.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
import socket

import torch
from prometheus_client import CollectorRegistry

import hiermem as hm
from hiermem.nn.data import ZipfIds


def _scrape(port: int) -> bytes:
    """GET /metrics with a bare HTTP/1.0 request: the scraper stands in for an external
    Prometheus, so its own client work (urllib's is ~2 ms a call) is kept small."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as so:
        so.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        chunks = []
        while chunk := so.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    ap.add_argument("--batch", type=int, default=8192, help="ids per table per step")
    ap.add_argument("--num-rows", type=int, default=1_000_000)
    ap.add_argument("--interval", type=float, default=1.0,
                    help="seconds between scrapes (default 1: 5x the shipped prometheus.yml's rate; "
                         "0.1 is a stress setting)")
    ap.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps = 3, 10
    tmp = tempfile.mkdtemp(prefix="hiermem-bench-metrics-")
    tables = [hm.TableSpec("user", a.num_rows, 32), hm.TableSpec("item_hash", None, 32)]
    store = hm.HierarchicalStore(tables, hm.StoreConfig(
        path=f"{tmp}/store", device="cpu", device_rows=a.num_rows // 100, host_rows=a.num_rows // 10,
        optimizer=hm.RowWiseAdagrad(lr=0.05), seed=0))
    gens = {"user": ZipfIds(a.num_rows, 1.05, seed=0), "item_hash": ZipfIds(a.num_rows * 100, 1.05, seed=1)}
    stores = hm.MetricsRegistry()
    stores.add(store, "bench")

    def steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            for name, gen in gens.items():
                ids = torch.from_numpy(gen(a.batch))
                rows = store.lookup(name, ids)
                store.update(name, ids, rows * 0.01)
        return time.perf_counter() - t0

    steps(a.steps)  # warm up: fill the tiers
    on_t, off_t, scrapes = [], [], [0]
    server = None
    try:
        for r in range(a.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                if mode == "off":
                    off_t.append(steps(a.steps))
                    continue
                server, _ = hm.serve_metrics(0, registry=CollectorRegistry(), stores=stores)
                port = server.server_port
                stop = threading.Event()

                def scrape():
                    while not stop.is_set():
                        assert b"hiermem_lookups_total" in _scrape(port)
                        scrapes[0] += 1
                        stop.wait(a.interval)
                th = threading.Thread(target=scrape, daemon=True)
                th.start()
                on_t.append(steps(a.steps))
                stop.set()
                th.join(10)
                server.shutdown()
                server.server_close()
                server = None
    finally:
        if server is not None:
            server.shutdown()
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)
    n = a.rounds * a.steps
    out = {
        "rounds": a.rounds, "steps_per_mode": n, "ids_per_step": 2 * a.batch, "scrapes": scrapes[0],
        "step_s_off": round(sum(off_t) / n, 6), "step_s_on": round(sum(on_t) / n, 6),
        "median_round_ratio": round(statistics.median(x / y for x, y in zip(on_t, off_t)), 4),
        "metrics_overhead": round(sum(on_t) / sum(off_t), 4),
    }
    print(f"step time off {out['step_s_off'] * 1e3:.2f} ms, on {out['step_s_on'] * 1e3:.2f} ms "
          f"({scrapes[0]} scrapes every {a.interval} s)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
