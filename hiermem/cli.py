"""The ``hiermem`` command."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import HierMemError


def _demo(a: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    sizes = _policy_sizes(a)
    server = None
    if a.metrics_port is not None:
        server = _serve(a.metrics_port, a.metrics_addr)
    try:
        run_demo(DemoConfig(steps=a.steps, batch=a.batch, dim=a.dim, table_factor=a.table_factor, policy=a.policy, **sizes,
                            checkpoint_every=a.checkpoint_every, device=a.device, path=a.path, seed=a.seed,
                            synthetic=a.synthetic, criteo=a.criteo, resume=a.resume, progress=not a.no_progress))
    finally:
        if server is not None:
            server.shutdown()
    return 0


def _policy_sizes(a: argparse.Namespace) -> dict:
    """--device-rows, --host-rows, --depth: as given, else the --policy file's, else the
    defaults; the effective values are printed with where each came from."""
    from .eviction import policy_settings

    f, out, said = policy_settings(a.policy), {}, []
    for arg, key, default in (("device_rows", "device_rows", 16384), ("host_rows", "host_rows", 65536),
                              ("depth", "prefetch_depth", 2)):
        given = getattr(a, arg)
        out[arg], src = (given, "argument") if given is not None else \
            (f[key], a.policy) if key in f else (default, "default")
        said.append(f"{arg}={out[arg]} ({src})")
    print("hiermem: " + ", ".join(said), file=sys.stderr, flush=True)
    return out


def _export(a: argparse.Namespace) -> int:
    from .readonly import export_npy

    n, seq = export_npy(a.path, a.table, a.out)
    print(f"hiermem: wrote {n} rows of {a.table} to {a.out} (flush {seq})", file=sys.stderr)
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


def _plan(a: argparse.Namespace) -> int:
    from .sharding import plan
    from .sharding.config import format_plan, load_config

    c = load_config(a.config)
    p = plan(c.tables, c.topology, c.batch_size, c.optimizer)
    if a.json:
        print(p.to_json(indent=2))
    else:
        print(format_plan(p))
        print(f"\nslowest rank: {p.estimated_ms:.4f} ms estimated per step "
              f"({len(p.tables)} tables, {p.world_size} ranks)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hiermem", description="Hierarchical embedding memory for PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small DLRM with embeddings beyond the device tier (Criteo data)")
    d.add_argument("--steps", type=int, default=300, help="train until this step (default 300)")
    d.add_argument("--batch", type=int, default=256, help="samples per step")
    d.add_argument("--dim", type=int, default=16, help="embedding dimension")
    d.add_argument("--device-rows", type=int, default=None,
                   help="device tier rows (tables are 10x this; default: the policy file's, else 16384)")
    d.add_argument("--host-rows", type=int, default=None, help="host tier rows (default: the policy file's, else 65536)")
    d.add_argument("--table-factor", type=int, default=10, help="bounded tables' size / device tier")
    d.add_argument("--depth", type=int, default=None, help="prefetch depth (0: none; default: the policy file's, else 2)")
    d.add_argument("--policy", default="lru", help="lru, lfu or a policies/*.toml file")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    d.add_argument("--path", default="runs/demo", help="run directory (store and checkpoints)")
    d.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    d.add_argument("--seed", type=int, default=0)
    src = d.add_mutually_exclusive_group()
    src.add_argument("--synthetic", action="store_true", help="synthetic Criteo-like data")
    src.add_argument("--criteo", default=None, metavar="PATH", help="a Criteo-layout TSV file (streamed)")
    d.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    x = sub.add_parser("export", help="write a table's rows (ids, weights) to .npy; works while a process trains")
    x.add_argument("path")
    x.add_argument("--table", required=True)
    x.add_argument("--out", required=True, help="FILE.npy (a structured array: id int64, weight float32[dim])")
    x.set_defaults(fn=_export)
    pl = sub.add_parser("plan", help="plan table/row/column/data-parallel sharding and tiers (TOML or JSON config)")
    pl.add_argument("config", help="e.g. hiermem/sharding/example_plan.toml")
    pl.add_argument("--json", action="store_true", help="print the ShardingPlan as JSON")
    pl.set_defaults(fn=_plan)
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
