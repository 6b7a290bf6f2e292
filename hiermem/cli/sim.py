"""``hiermem trace import``, ``hiermem sim`` and ``hiermem tune`` (wired into hiermem.cli)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import HierMemError


def _trace_import(a: argparse.Namespace) -> int:
    from ..observe.trace import load_trace
    from ..sim.datasets import import_criteo, import_movielens, import_npy

    dest = Path(a.out)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise HierMemError(f"{dest}: exists and is not an empty directory; pick a new trace directory "
                           "(e.g. under runs/)")
    if a.kind == "npy":
        _check_npy(Path(a.src))
        out = import_npy(a.src, a.out, table=a.table, batch_size=a.batch_size)
    elif a.kind == "criteo":
        out = import_criteo(a.out, batch_size=a.batch_size, data_dir=a.data_dir)
    else:
        out = import_movielens(a.out, batch_size=a.batch_size, stream=a.stream, data_dir=a.data_dir)
    t = load_trace(out)
    print(json.dumps({"trace": str(out), "tables": list(t.tables), "batches": t.num_batches,
                      "accesses": t.accesses, "updates": t.updates}))
    return 0


def _check_npy(src: Path) -> None:
    """Refuse a file that is not a .npy array before numpy reads it."""
    try:
        with open(src, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise HierMemError(f"{src}: cannot read: {e.strerror or e}") from None
    if magic != b"\x93NUMPY":
        raise HierMemError(f"{src}: not a .npy file (expected a 1-D integer id array saved with numpy.save)")


def _format_sim(out: dict) -> str:
    """Every tier's hits and misses and the step-time estimate, for people."""
    lines = [f"{out['policy']}: {out['accesses']:,} accesses in {out['batches']:,} batches, "
             f"device {out['device_rows']:,} rows, host {out['host_rows']:,} rows, prefetch depth "
             f"{out['prefetch_depth']}"]
    for tier in ("device", "host", "disk"):
        t = out[tier]
        look = t.get("lookups", t["hits"] + t["misses"])
        rate = t["hits"] / look if look else 0.0
        what = {"device": "of all accesses", "host": "of device misses",
                "disk": "of host misses; hits = read back from disk"}[tier]
        lines.append(f"  {tier:6s} hits {t['hits']:>10,}  misses {t['misses']:>10,}  hit rate {rate:.4f} ({what})")
    est = out["est_step"]
    parts = ", ".join(f"{k} {1e3 * v:.3f}" for k, v in est.items() if isinstance(v, (int, float)) and k != "total")
    lines.append(f"  estimated step time {1e3 * out['est_step_seconds']:.3f} ms ({parts} ms; "
                 f"{out['degraded_batches']} degraded prefetches)")
    return "\n".join(lines)


def _sim(a: argparse.Namespace) -> int:
    from ..sim.engine import SimConfig, dense_rows, simulate
    from ..observe.trace import load_trace

    trace = load_trace(a.trace)
    if a.policy == "belady":
        from ..sim.bounds import belady_misses

        misses = belady_misses(dense_rows(trace)[0], a.device_rows)
        out = {"accesses": trace.accesses, "batches": trace.num_batches, "policy": "belady",
               "device_rows": a.device_rows, "device": {"hits": trace.accesses - misses, "misses": misses},
               "device_hit_rate": (trace.accesses - misses) / max(1, trace.accesses),
               "note": "optimal per-access demand paging for one tier of device_rows rows"}
    else:
        policy = a.policy
        if a.admission is not None:  # the policy (a name or a file) with this admission filter
            from ..core.policies import PolicySpec, resolve_policy

            spec = resolve_policy(a.policy)
            policy = PolicySpec(spec.name, {**spec.params, "admission": a.admission}, spec.source)
        res = simulate(trace, SimConfig(device_rows=a.device_rows, host_rows=a.host_rows, policy=policy,
                                        prefetch_depth=a.prefetch_depth, row_bytes=a.row_bytes))
        out = res.to_dict()
    if a.json:
        print(json.dumps(out))
    elif a.policy == "belady":
        d = out["device"]
        print(f"belady: {out['accesses']:,} accesses, device {a.device_rows:,} rows: hits {d['hits']:,} misses "
              f"{d['misses']:,} (hit rate {out['device_hit_rate']:.4f}; {out['note']})")
    else:
        print(_format_sim(out))
    return 0


def _tune(a: argparse.Namespace) -> int:
    from ..sim.tune import TuneConfig, tune

    cfg = TuneConfig(device_rows=a.device_rows, host_rows=a.host_rows, memory_budget_rows=a.memory_budget_rows,
                     max_prefetch_depth=a.max_prefetch_depth, row_bytes=a.row_bytes, curve_points=a.curve_points)
    result = tune(a.trace, cfg, out_dir=a.out_dir, name=a.name, plot=a.plot, progress=not a.quiet)
    print(result.table())
    print(f"winner: {result.winner.label} -> {result.policy_file}")
    if result.plot_file is not None:
        print(f"plot: {result.plot_file}")
    if a.json:
        print(json.dumps(result.to_dict()))
    return 0


def add_commands(sub: argparse._SubParsersAction, formatter_class=argparse.HelpFormatter) -> None:
    """Add ``trace``, ``sim`` and ``tune`` to the ``hiermem`` parser."""
    fc = {"formatter_class": formatter_class}
    tr = sub.add_parser("trace", help="access traces: import real logs or id streams", **fc)
    tsub = tr.add_subparsers(dest="trace_cmd", required=True)
    imp = tsub.add_parser("import", help="write a trace from a raw id stream or a shared data set", **fc)
    isub = imp.add_subparsers(dest="kind", required=True)
    n = isub.add_parser("npy", help="a raw 1-D int64 id stream (.npy) as a one-table trace", **fc)
    n.add_argument("src", help="the .npy id array")
    n.add_argument("out", help="trace directory to write")
    n.add_argument("--table", required=True, help="table name")
    n.add_argument("--batch-size", type=int, required=True, help="ids per batch")
    c = isub.add_parser("criteo", help="the shared Criteo head: 26 tables C1..C26", **fc)
    c.add_argument("out", help="trace directory to write")
    c.add_argument("--batch-size", type=int, required=True, help="samples per batch")
    c.add_argument("--data-dir", default=None, help="shared data folder (default: ../shared/data)")
    m = isub.add_parser("movielens", help="the shared MovieLens ratings, by time", **fc)
    m.add_argument("out", help="trace directory to write")
    m.add_argument("--batch-size", type=int, required=True, help="ratings per batch")
    m.add_argument("--stream", default="items", choices=["items", "users", "both"],
                   help="which ids: item ids, user ids, or both (tables item and user)")
    m.add_argument("--data-dir", default=None, help="shared data folder (default: ../shared/data)")
    imp.set_defaults(fn=_trace_import)

    s = sub.add_parser("sim", help="replay a trace through a policy and tier sizes", **fc)
    s.add_argument("trace", help="trace directory (from hiermem trace import or store.record)")
    s.add_argument("--policy", required=True, help="a policy name, a policies/*.toml file, or belady")
    s.add_argument("--device-rows", type=int, required=True, help="device tier rows")
    s.add_argument("--host-rows", type=int, default=0, help="host tier rows (default 0: device over disk)")
    s.add_argument("--prefetch-depth", type=int, default=0, help="batches prefetched ahead (0: none)")
    s.add_argument("--row-bytes", type=int, default=256, help="bytes per row record, for bytes moved")
    s.add_argument("--admission", choices=["off", "tinylfu"], default=None,
                   help="the admission filter in front of the device tier (default: the policy's own, off)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(fn=_sim)

    t = sub.add_parser("tune", help="search policies and parameters on a trace; write the winner", **fc)
    t.add_argument("--trace", required=True, help="trace directory to tune on")
    t.add_argument("--device-rows", type=int, required=True, help="device tier rows")
    t.add_argument("--host-rows", type=int, required=True, help="host tier rows")
    t.add_argument("--memory-budget-rows", type=int, default=None,
                   help="device + host rows to split (default: device-rows + host-rows, split as given)")
    t.add_argument("--max-prefetch-depth", type=int, default=2, help="prefetch depths 0..N are tried")
    t.add_argument("--row-bytes", type=int, default=256, help="bytes per row record, for bytes moved")
    t.add_argument("--curve-points", type=int, default=8, help="device capacities per miss-ratio curve")
    t.add_argument("--out-dir", default="runs/policies", help="where the winner's <name>.toml goes")
    t.add_argument("--name", default="tuned", help="policy file name (without .toml)")
    t.add_argument("--plot", default=None, help="PNG of miss-ratio curves (default: <out-dir>/<name>.png)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="also print the ranking as JSON")
    t.set_defaults(fn=_tune)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0)
