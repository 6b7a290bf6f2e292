"""Planner configs (TOML or JSON) and the text table ``hiermem plan`` prints.

A config names the topology, the batch size per rank, the optimizer and the tables::

    batch_size = 512
    optimizer = { name = "rowwise_adagrad", lr = 0.01 }
    [topology]
    world_size = 16
    ranks_per_host = 8
    device_bytes = 16e9
    [[tables]]
    name = "user"
    num_rows = 100_000_000
    dim = 128
    pooling_factor = 20.0
    zipf_alpha = 1.1
    # miss_ratio_curve = [[1e5, 0.6], [1e6, 0.3], [1e7, 0.1]]

Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import InvalidArgumentError
from ..dataplane.optim import Optimizer, optimizer_from_dict
from .types import PlannerTable, ShardingPlan, Topology

GB = 1e9


@dataclass(frozen=True)
class PlanConfig:
    """What :func:`~hiermem.sharding.plan` needs, as read from a file."""

    tables: tuple[PlannerTable, ...]
    topology: Topology
    batch_size: int
    optimizer: Optimizer


def _build(cls, d: dict, what: str):
    names = {f.name for f in fields(cls)}
    bad = set(d) - names
    if bad:
        raise InvalidArgumentError(f"{what}: unknown keys {sorted(bad)}; known: {sorted(names)}")
    try:
        return cls(**d)
    except TypeError as e:
        raise InvalidArgumentError(f"{what}: {e}") from e


def _int_fields(d: dict, keys) -> dict:
    """TOML/JSON floats like ``16e9`` for int fields -> int (exact values only)."""
    out = dict(d)
    for k in keys:
        v = out.get(k)
        if isinstance(v, float) and v.is_integer():
            out[k] = int(v)
    return out


def parse_config(d: dict) -> PlanConfig:
    """A :class:`PlanConfig` from a parsed TOML/JSON document."""
    if not isinstance(d, dict):
        raise InvalidArgumentError("a plan config is a table/object")
    bad = set(d) - {"tables", "topology", "batch_size", "optimizer"}
    if bad:
        raise InvalidArgumentError(f"unknown keys {sorted(bad)} in plan config")
    if not d.get("tables"):
        raise InvalidArgumentError("plan config needs at least one [[tables]] entry")
    topo = _build(Topology, _int_fields(d.get("topology", {}), ("world_size", "ranks_per_host")), "topology")
    tabs = []
    for i, t in enumerate(d["tables"]):
        t = _int_fields(t, ("num_rows", "dim"))
        if "miss_ratio_curve" in t:
            t["miss_ratio_curve"] = tuple(tuple(p) for p in t["miss_ratio_curve"])
        tabs.append(_build(PlannerTable, t, f"tables[{i}]"))
    opt = optimizer_from_dict(d.get("optimizer", {"name": "sgd"}))
    b = d.get("batch_size", 512)
    if isinstance(b, float) and b.is_integer():
        b = int(b)
    return PlanConfig(tuple(tabs), topo, b, opt)


def load_config(path: str | os.PathLike) -> PlanConfig:
    """Read a ``.toml`` or ``.json`` plan config."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise InvalidArgumentError(f"{p}: cannot read ({e.strerror})") from e
    try:
        if p.suffix.lower() == ".json":
            d = json.loads(raw)
        else:
            import tomllib

            d = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"{p}: not valid {'JSON' if p.suffix.lower() == '.json' else 'TOML'}: {e}") \
            from e
    return parse_config(d)


def _ranks(rs) -> str:
    rs = sorted(rs)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def _bytes(x: float) -> str:
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= f:
            return f"{x / f:.1f}{unit}"
    return f"{x:.0f}B"


def format_plan(p: ShardingPlan, max_tables: int | None = None) -> str:
    """The plan as a text table: one line per table, then one per rank."""
    head = f"{'table':<24} {'sharding':<8} {'ranks':<12} {'tier':<14} {'cache rows (dev/host)':<24} " \
           f"{'est ms/rank':>11} {'device/rank':>12} {'host/rank':>10} {'ssd/rank':>10}"
    lines = [head, "-" * len(head)]
    tabs = p.tables if max_tables is None else p.tables[:max_tables]
    for t in tabs:
        s0 = t.shards[0]
        tiers = "/".join(sorted({s.tier.value for s in t.shards}))
        cache = f"{s0.device_rows}/{s0.host_rows}" + ("" if len({(s.device_rows, s.host_rows) for s in t.shards}) == 1
                                                      else " (varies)")
        n = len(t.shards)
        lines.append(f"{t.name[:24]:<24} {t.sharding.value:<8} {_ranks(t.ranks)[:12]:<12} {tiers[:14]:<14} "
                     f"{cache[:24]:<24} {max(s.est_ms for s in t.shards):>11.4f} "
                     f"{_bytes(sum(s.device_bytes for s in t.shards) / n):>12} "
                     f"{_bytes(sum(s.host_bytes for s in t.shards) / n):>10} "
                     f"{_bytes(sum(s.ssd_bytes for s in t.shards) / n):>10}")
    if max_tables is not None and len(p.tables) > max_tables:
        lines.append(f"... {len(p.tables) - max_tables} more tables")
    lines.append("")
    lines.append(f"{'rank':<6} {'est ms':>10} {'device':>10} {'host':>10} {'ssd':>10}")
    for r, (ms, b) in enumerate(zip(p.rank_ms, p.rank_bytes())):
        lines.append(f"{r:<6} {ms:>10.4f} {_bytes(b['device']):>10} {_bytes(b['host']):>10} {_bytes(b['ssd']):>10}")
    return "\n".join(lines)


def summary(p: ShardingPlan) -> dict:
    """Counts and extremes of a plan (what ``scripts/plan_scale.py`` prints)."""
    from collections import Counter

    rb = p.rank_bytes()
    return {
        "tables": len(p.tables),
        "world_size": p.world_size,
        "shardings": dict(Counter(t.sharding.value for t in p.tables)),
        "tiers": dict(Counter(s.tier.value for t in p.tables for s in t.shards)),
        "shards": sum(len(t.shards) for t in p.tables),
        "max_rank_ms": max(p.rank_ms),
        "min_rank_ms": min(p.rank_ms),
        "max_device_bytes": max(b["device"] for b in rb),
        "max_host_bytes": max(b["host"] for b in rb),
        "max_ssd_bytes": max(b["ssd"] for b in rb),
    }
