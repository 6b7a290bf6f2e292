"""The ``hiermem`` command."""

from __future__ import annotations

import argparse
import errno
import json
import sys

from importlib.metadata import PackageNotFoundError, version
from ..errors import HierMemError


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, but not the ``None``/``False`` of flags whose help says what they do."""

    def _get_help_string(self, action):
        if any(action.default is d for d in (None, False, argparse.SUPPRESS)) or "default" in (action.help or ""):
            # `is`, not `in`: a default of 0 equals False and is still shown
            return action.help
        return super()._get_help_string(action)


def positive(s: str) -> int:
    """argparse type: an integer > 0 (argparse names the flag in its error)."""
    v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def non_negative(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def port(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 (0: any free port), got {v}")
    return v


def _demo(a: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    sizes = _policy_sizes(a)
    cfg = DemoConfig(steps=a.steps, epochs=a.epochs, batch=a.batch, dim=a.dim, device_rows=sizes["device_rows"],
                     host_rows=sizes["host_rows"], table_factor=a.table_factor, depth=sizes["depth"], policy=a.policy,
                     lr=a.lr, dense_lr=a.dense_lr, seed=a.seed, synthetic=a.synthetic, criteo=a.criteo,
                     checkpoint_every=a.checkpoint_every, keep_checkpoints=a.keep_checkpoints, device=a.device,
                     path=a.path, resume=a.resume, fresh=a.fresh, progress=not a.no_progress,
                     log_every=a.log_every, png=not a.no_png)
    server = _serve(a.metrics_port, a.metrics_addr, "--metrics-port") if a.metrics_port is not None else None
    try:
        run_demo(cfg)
    finally:
        if server is not None:
            server.shutdown()
    return 0


def _policy_sizes(a: argparse.Namespace) -> dict:
    """--device-rows, --host-rows, --depth: as given, else the --policy file's, else None
    (the demo's default, or the resumed run's); when the file names any of them, the
    effective values are printed with where each came from."""
    from ..core.policies import policy_settings

    f, out, said = policy_settings(a.policy) if a.policy else {}, {}, []
    for arg, key in (("device_rows", "device_rows"), ("host_rows", "host_rows"), ("depth", "prefetch_depth")):
        given = getattr(a, arg)
        out[arg], src = (given, "argument") if given is not None else \
            (f[key], a.policy) if key in f else (None, "the demo's default")
        said.append(f"{arg}={out[arg] if out[arg] is not None else '-'} ({src})")
    if f:
        print("hiermem: " + ", ".join(said), file=sys.stderr, flush=True)
    return out


def _export(a: argparse.Namespace) -> int:
    from ..store.readonly import export_npy

    n, seq = export_npy(a.path, a.table, a.out)
    print(f"hiermem: wrote {n} rows of {a.table} to {a.out} (flush {seq})", file=sys.stderr)
    return 0


def _serve(port: int, addr: str, flag: str = "--port"):
    from ..observe.metrics import serve_metrics

    try:
        server, _thread = serve_metrics(port, addr)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise HierMemError(f"{addr}:{port} is already in use: pick another {flag} (0 picks a free one)") from None
        raise HierMemError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from None
    print(f"hiermem: metrics on http://{addr}:{server.server_port}/metrics", file=sys.stderr, flush=True)
    return server


def _open_idle(path: str):
    """Open a store for reading its counters; a store in use says where its live metrics are."""
    from ..store.hierarchical import HierarchicalStore

    try:
        return HierarchicalStore.open(path, device="cpu")
    except HierMemError as e:
        if "open in another process" in str(e) or "already open" in str(e):
            raise HierMemError(f"{e}. A store being trained is open in its training process: live metrics "
                               "come from that process (`hiermem demo --metrics-port PORT`, or "
                               "`hm.serve_metrics()` in your script); stats and serve read a store at rest") from None
        raise


def _serve_cmd(a: argparse.Namespace) -> int:
    import time

    with _open_idle(a.path) as s:
        s.count_from_creation()  # serve the lifetime counters saved with the store, not zeros
        server = _serve(a.port, a.addr)
        print(f"hiermem: serving {s.path} (counters cumulative since it was created); Ctrl-C stops",
              file=sys.stderr, flush=True)
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
    with _open_idle(a.path) as s:
        st = s.stats(cumulative=True)
        if a.json:
            print(json.dumps({"store": repr(s), "stats": st}, indent=2))
        else:
            print(format_stats(s, st))
    return 0


def format_stats(store, st: dict) -> str:
    """A short human summary of ``store.stats(cumulative=True)``."""
    g = st["_store"]
    names = [t.name for t in store.tables]
    unb = sum(1 for t in store.tables if t.num_rows is None)
    lines = [f"store {store.path}: {len(names)} tables ({unb} unbounded), optimizer {store.optimizer.to_dict()['name']}"
             f", policy {g['policy']}",
             f"tiers: device {g['device_capacity']:,} rows, host {g['host_capacity']:,} rows, "
             f"LMDB {g['disk_rows']:,} rows ({g['lmdb_map_size'] / 2**20:.0f} MiB map)",
             "counters over the store's life (saved at every flush and checkpoint):"]
    for tier in ("device", "host", "disk"):
        look = sum(st[n][tier]["lookups"] for n in names)
        hits = sum(st[n][tier]["hits"] for n in names)
        ev = sum(st[n][tier]["evictions"] for n in names)
        wb = sum(st[n][tier]["writebacks"] for n in names)
        rate = f"{hits / look:.3f}" if look else "-"
        lines.append(f"  {tier:6s} lookups {look:>12,}  hits {hits:>12,}  hit rate {rate:>5}  "
                     f"evictions {ev:>10,}  write-backs {wb:>10,}")
    lines.append(f"  updates {g['updates']:,} ({g['updated_rows']:,} rows), flushes {g['flushes']:,}, "
                 f"prefetched batches {g['prefetched_batches']:,}")
    mb = {k: g[f"bytes_{k}"] / 2**20 for k in ("host_to_device", "device_to_host", "disk_to_host", "host_to_disk")}
    lines.append("  moved: " + ", ".join(f"{k.replace('_to_', '->')} {v:,.1f} MiB" for k, v in mb.items()))
    lines.append("(--json prints every counter per table; live metrics come from the training process: "
                 "--metrics-port or hm.serve_metrics)")
    return "\n".join(lines)


def _plan(a: argparse.Namespace) -> int:
    from ..sharding import plan
    from ..sharding.config import format_plan, load_config

    c = load_config(a.config)
    p = plan(c.tables, c.topology, c.batch_size, c.optimizer)
    if a.json:
        print(p.to_json(indent=2))
    else:
        print(format_plan(p))
        print(f"\nslowest rank: {p.estimated_ms:.4f} ms estimated per step "
              f"({len(p.tables)} tables, {p.world_size} ranks)")
    return 0


def _add_demo(sub) -> None:
    d = sub.add_parser("demo", formatter_class=_Help,
                       help="train a small DLRM with embeddings beyond the device tier (Criteo data)",
                       description="Train a small DLRM whose 26 embedding tables live in device, host and LMDB "
                                   "tiers. Run settings left out take the data's defaults, or with --resume the "
                                   "run's saved ones.")
    d.add_argument("--steps", type=positive, default=None,
                   help="train until this step (default: 3 epochs of the real data, else 300)")
    d.add_argument("--epochs", type=positive, default=None, help="train until this epoch (real data; default 3)")
    d.add_argument("--batch", type=positive, default=None, help="samples per step (default 256)")
    d.add_argument("--dim", type=positive, default=None, help="embedding dimension (default 16)")
    d.add_argument("--device-rows", type=positive, default=None,
                   help="device tier rows (default: the --policy file's, else 4096 for the real data, else 16384)")
    d.add_argument("--host-rows", type=non_negative, default=None,
                   help="host tier rows (default: the --policy file's, else 12288 for the real data, else 65536)")
    d.add_argument("--table-factor", type=positive, default=None,
                   help="bounded tables' size / device tier (default 10)")
    d.add_argument("--depth", type=non_negative, default=None, help="prefetch depth, 0: none (default: the --policy file's, else 2)")
    d.add_argument("--policy", default=None, help="lru, lfu or a policies/*.toml file (default lru)")
    d.add_argument("--lr", type=float, default=None,
                   help="row-wise Adagrad rate of the embeddings (default: 0.003 on the real data, else 0.05)")
    d.add_argument("--dense-lr", type=float, default=None,
                   help="Adam rate of the MLPs (default: 0.001 on the real data, else 0.003)")
    d.add_argument("--seed", type=int, default=None, help="seed of the model, hashing and data order (default 0)")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--synthetic", action="store_true", help="synthetic Criteo-like data")
    src.add_argument("--criteo", default=None, metavar="PATH", help="a Criteo-layout TSV file (streamed)")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    d.add_argument("--path", default="runs/demo",
                   help="run directory; if it holds a run, a new run goes to PATH-2, PATH-3, ...")
    d.add_argument("--resume", action="store_true",
                   help="continue the run in --path from its last checkpoint, with its saved settings")
    d.add_argument("--fresh", action="store_true", help="replace the run in --path (deletes it)")
    d.add_argument("--checkpoint-every", type=non_negative, default=None,
                   help="steps between checkpoints (default: an epoch of the real data, else 100)")
    d.add_argument("--keep-checkpoints", type=positive, default=2, help="keep the last N checkpoints")
    d.add_argument("--no-progress", action="store_true", help="a log line every --log-every steps, not a bar")
    d.add_argument("--log-every", type=positive, default=25, help="steps between log lines with --no-progress")
    d.add_argument("--no-png", action="store_true", help="do not save demo.png (loss and hit rates)")
    d.add_argument("--metrics-port", type=port, default=None, help="serve Prometheus /metrics on this port (default: none)")
    d.add_argument("--metrics-addr", default="127.0.0.1", help="address for /metrics")
    d.set_defaults(fn=_demo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hiermem", formatter_class=_Help,
                                description="Hierarchical embedding memory for PyTorch.",
                                epilog="hiermem CMD --help lists every option of CMD with its default.")
    p.add_argument("--version", action="version", version=f"hiermem {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_demo(sub)
    v = sub.add_parser("serve", formatter_class=_Help,
                       help="keep a store at rest open and serve its Prometheus /metrics")
    v.add_argument("path", help="the store's directory")
    v.add_argument("--port", type=port, default=9400, help="port to bind")
    v.add_argument("--addr", default="127.0.0.1", help="address to bind")
    v.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until Ctrl-C)")
    v.set_defaults(fn=_serve_cmd)
    s = sub.add_parser("stats", formatter_class=_Help, help="summarise a store's layout and lifetime counters")
    s.add_argument("path", help="the store's directory")
    s.add_argument("--json", action="store_true", help="every counter per table and tier, as JSON")
    s.set_defaults(fn=_stats)
    x = sub.add_parser("export", formatter_class=_Help,
                       help="write a table's rows (ids, weights) to .npy; works while a process trains")
    x.add_argument("path", help="the store's directory")
    x.add_argument("--table", required=True, help="table name")
    x.add_argument("--out", required=True, help="FILE.npy (a structured array: id int64, weight float32[dim])")
    x.set_defaults(fn=_export)
    pl = sub.add_parser("plan", formatter_class=_Help,
                        help="plan table/row/column/data-parallel sharding and tiers (TOML or JSON config)")
    pl.add_argument("config", help="e.g. hiermem/sharding/example_plan.toml")
    pl.add_argument("--json", action="store_true", help="print the ShardingPlan as JSON")
    pl.set_defaults(fn=_plan)
    from .sim import add_commands  # trace import, sim, tune (offline policy tuning)

    add_commands(sub, formatter_class=_Help)
    return p


def _version() -> str:
    try:
        return version("hiermem")
    except PackageNotFoundError:  # run from a checkout that pip never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    from .demo import Interrupted

    try:
        a = build_parser().parse_args(argv)
        return a.fn(a)
    except Interrupted as e:
        print(f"hiermem: interrupted: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("\nhiermem: interrupted", file=sys.stderr)
        return 130
    except HierMemError as e:
        print(f"hiermem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
