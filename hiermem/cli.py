"""The ``hiermem`` command."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import HierMemError


def _demo(a: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    server = None
    if a.metrics_port is not None:
        server = _serve(a.metrics_port, a.metrics_addr)
    try:
        run_demo(DemoConfig(steps=a.steps, batch=a.batch, num_rows=a.num_rows, device_rows=a.device_rows,
                            host_rows=a.host_rows, policy=a.policy, device=a.device, path=a.path, seed=a.seed))
    finally:
        if server is not None:
            server.shutdown()
    return 0


def _serve(port: int, addr: str):
    from .metrics import serve_metrics

    server, _thread = serve_metrics(port, addr)
    print(f"hiermem: metrics on http://{addr}:{server.server_port}/metrics", file=sys.stderr, flush=True)
    return server


def _serve_cmd(a: argparse.Namespace) -> int:
    import time

    from .store import HierarchicalStore

    with HierarchicalStore.open(a.path, device="cpu") as s:
        server = _serve(a.port, a.addr)
        print(f"hiermem: serving {s}; Ctrl-C stops", file=sys.stderr, flush=True)
        try:
            deadline = None if a.seconds is None else time.monotonic() + a.seconds
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
    return 0


def _stats(a: argparse.Namespace) -> int:
    from .store import HierarchicalStore

    with HierarchicalStore.open(a.path, device="cpu") as s:
        print(json.dumps({"store": repr(s), "stats": s.stats()}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hiermem", description="Hierarchical embedding memory for PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="lookup/update steps through device, host and LMDB tiers")
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--batch", type=int, default=2048, help="samples per step (20 ids each)")
    d.add_argument("--num-rows", type=int, default=1_000_000)
    d.add_argument("--device-rows", type=int, default=10_000)
    d.add_argument("--host-rows", type=int, default=100_000)
    d.add_argument("--policy", default="lru", help="lru, lfu or a policies/*.toml file")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    d.add_argument("--path", default=None, help="store directory (default: a temporary one)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    d.add_argument("--metrics-addr", default="127.0.0.1", help="address for /metrics (default: loopback)")
    d.set_defaults(fn=_demo)
    v = sub.add_parser("serve", help="keep a store open and serve its Prometheus /metrics")
    v.add_argument("path")
    v.add_argument("--port", type=int, default=9400)
    v.add_argument("--addr", default="127.0.0.1", help="address to bind (default: loopback)")
    v.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until Ctrl-C)")
    v.set_defaults(fn=_serve_cmd)
    s = sub.add_parser("stats", help="print a store's layout and counters")
    s.add_argument("path")
    s.set_defaults(fn=_stats)
    from .sim.cli import add_commands  # trace import, sim, tune (offline policy tuning)

    add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except HierMemError as e:
        print(f"hiermem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
