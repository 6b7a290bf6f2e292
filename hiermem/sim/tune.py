"""The tuner: simulate candidate policies, parameters, prefetch depths and tier splits on a
trace, rank them, plot miss-ratio curves, and write the winner as a policy file.

Stages (each a small pure step, as a planner's): enumerate :class:`Candidate` s ->
simulate each (:func:`~hiermem.sim.simulate`) -> rank by the cost model's estimated step
time, then device misses -> curves of every policy family (its best parameters) over
device capacities, with Belady's MIN and the per-access LRU curve -> a TOML policy file
that ``StoreConfig(policy=path)`` loads.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import InvalidArgumentError, InvalidTypeError, MissingDependencyError
from ..core.policies import POLICIES, PolicySpec
from .bounds import belady_misses, lru_mrc
from .cost import CostModel
from .engine import SimConfig, SimResult, dense_rows, simulate
from ..observe.trace import Trace, load_trace


@dataclass(frozen=True)
class TuneConfig:
    """The search space.

    Args:
        device_rows, host_rows: the tier sizes to tune for.
        memory_budget_rows: device + host rows to split; when set, device shares of
            100%, 75% and 50% of ``device_rows`` are tried, the host taking the rest.
        max_prefetch_depth: prefetch depths ``0..max`` are tried.
        row_bytes: bytes per row record (weights + optimizer state).
        cost: the cost model that ranks candidates.
        curve_points: device capacities per miss-ratio curve.
    """

    device_rows: int
    host_rows: int
    memory_budget_rows: Optional[int] = None
    max_prefetch_depth: int = 2
    row_bytes: int = 256
    cost: CostModel = field(default_factory=CostModel)
    curve_points: int = 8

    def __post_init__(self) -> None:
        for k in ("device_rows", "host_rows", "max_prefetch_depth", "row_bytes", "curve_points"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidTypeError(f"{k} must be an int, got {v!r}")
            if v < (0 if k == "max_prefetch_depth" else 1):
                raise InvalidArgumentError(f"{k} must be positive, got {v}")
        b = self.memory_budget_rows
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= self.device_rows // 2):
            raise InvalidArgumentError(f"memory_budget_rows must be an int > device_rows / 2, got {b!r}")


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a policy with parameters, tier sizes and prefetch depth."""

    policy: str
    params: tuple[tuple[str, float | int | str], ...]
    device_rows: int
    host_rows: int
    prefetch_depth: int

    @property
    def spec(self) -> PolicySpec:
        return PolicySpec(self.policy, dict(self.params))

    @property
    def label(self) -> str:
        p = ",".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in self.params)
        return f"{self.policy}({p}) D={self.device_rows} H={self.host_rows} k={self.prefetch_depth}"


#: the admission filters tried beside none (``admission``, a parameter of every policy)
ADMISSION_GRID = ("tinylfu",)


def policy_grid(accesses: int) -> list[tuple[str, tuple]]:
    """Every registered policy with the parameter sets to try: a policy class's
    ``tune_grid(accesses)`` where it has one (lfu_decay's half-lives relative to the
    trace length, S3-FIFO's small-queue shares, W-TinyLFU's windows, lookahead's windows
    and bases), else its defaults alone; and its first set again with each admission
    filter of ``ADMISSION_GRID`` (so each family is ranked with and without one)."""
    grid: list[tuple[str, tuple]] = []
    for name, cls in POLICIES.items():
        sets = cls.tune_grid(accesses) if hasattr(cls, "tune_grid") else [{}]
        sets = list(sets) + [{**sets[0], "admission": a} for a in ADMISSION_GRID]
        grid.extend((name, tuple(sorted(p.items()))) for p in sets)
    return grid


def candidates(cfg: TuneConfig, accesses: int) -> list[Candidate]:
    """Every candidate of the search space."""
    if cfg.memory_budget_rows is None:
        splits = [(cfg.device_rows, cfg.host_rows)]
    else:
        devs = sorted({cfg.device_rows, cfg.device_rows * 3 // 4, cfg.device_rows // 2}, reverse=True)
        splits = [(d, cfg.memory_budget_rows - d) for d in devs if d >= 1 and cfg.memory_budget_rows - d >= 0]
    out = []
    for name, params in policy_grid(accesses):
        for d, h in splits:
            for k in range(cfg.max_prefetch_depth + 1):
                if name == "lookahead" and k == 0:
                    continue  # no pipeline, no future ids: plain LRU
                out.append(Candidate(name, params, d, h, k))
    return out


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    device_misses: int
    hit_rate: float
    step_seconds: float
    degraded: int

    def to_dict(self) -> dict:
        c = self.candidate
        return {"label": c.label, "policy": c.policy, "params": dict(c.params), "device_rows": c.device_rows,
                "host_rows": c.host_rows, "prefetch_depth": c.prefetch_depth, "device_misses": self.device_misses,
                "device_hit_rate": self.hit_rate, "est_step_seconds": self.step_seconds,
                "degraded_batches": self.degraded}


@dataclass
class TuneResult:
    """Ranked candidates (best first), the curves, and the files written."""

    ranked: list[Scored]
    curves: dict[str, tuple[list[int], list[float]]]
    accesses: int
    policy_file: Optional[Path] = None
    plot_file: Optional[Path] = None

    @property
    def winner(self) -> Candidate:
        return self.ranked[0].candidate

    def table(self, top: int = 15) -> str:
        """The ranking; the step-time column only where the estimates tell candidates apart."""
        ms = [1e3 * s.step_seconds for s in self.ranked[:top]]
        apart = bool(ms) and max(ms) - min(ms) > 1e-3 * max(max(ms), 1e-9)
        head = f"{'rank':>4}  {'candidate':<58} {'dev hit%':>8} {'misses':>9}"
        lines = [head + (f" {'step ms':>8}" if apart else "")]
        for i, s in enumerate(self.ranked[:top]):
            lines.append(f"{i + 1:>4}  {s.candidate.label:<58} {100 * s.hit_rate:>8.2f} {s.device_misses:>9}"
                         + (f" {ms[i]:>8.3f}" if apart else ""))
        if not apart and ms:
            lines.append(f"(estimated step times are equal ({ms[0]:.3f} ms): the cost model cannot tell these "
                         "candidates apart, so they are ranked by device misses)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"accesses": self.accesses, "ranked": [s.to_dict() for s in self.ranked],
                "curves": {k: {"capacity": c, "miss_ratio": m} for k, (c, m) in self.curves.items()},
                "policy_file": str(self.policy_file) if self.policy_file else None,
                "plot_file": str(self.plot_file) if self.plot_file else None}


def _progress(i: int, n: int, label: str, enabled: bool) -> None:
    if not enabled:
        return
    w = 30
    done = w * i // max(1, n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (w - done)}] {i}/{n} {label[:80]:<80}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _score(c: Candidate, r: SimResult) -> Scored:
    return Scored(c, r.device_misses, r.hit_rate, r.step.total, r.degraded)


def rank(scored: Sequence[Scored]) -> list[Scored]:
    """Best first: estimated step time, then device misses, then the label (stable)."""
    return sorted(scored, key=lambda s: (s.step_seconds, s.device_misses, s.candidate.label))


def curve_capacities(device_rows: int, distinct: int, points: int) -> list[int]:
    """Device capacities for the curves: geometric from ``device_rows/8`` to ``4 x``."""
    hi = max(2, min(4 * device_rows, distinct))
    lo = max(1, min(device_rows // 8, hi // 2))
    caps = np.unique(np.round(np.geomspace(lo, hi, points)).astype(np.int64))
    return [int(c) for c in caps]


def _curves(trace: Trace, ranked: list[Scored], cfg: TuneConfig, progress: bool) -> dict:
    dense = dense_rows(trace)[0]
    distinct = int(dense.max()) + 1 if dense.size else 1
    caps = curve_capacities(cfg.device_rows, distinct, cfg.curve_points)
    best: dict[str, Candidate] = {}
    for s in ranked:  # the best parameters (and depth) of each family
        c = s.candidate
        if c.policy not in best:
            best[c.policy] = c
    curves: dict[str, tuple[list[int], list[float]]] = {}
    n = trace.accesses or 1
    todo = len(best) * len(caps)
    for j, (fam, c) in enumerate(best.items()):
        ratios = []
        for i, cap in enumerate(caps):
            _progress(j * len(caps) + i, todo, f"curve {fam} {cap}", progress)
            r = simulate(trace, SimConfig(cap, c.host_rows, c.spec, c.prefetch_depth, row_bytes=cfg.row_bytes,
                                          cost=cfg.cost))
            ratios.append(r.device_misses / n)
        curves[f"{fam} (batch, k={c.prefetch_depth})"] = (caps, ratios)
    _progress(todo, todo, "curves", progress)
    curves["belady (per access)"] = (caps, [belady_misses(dense, cap) / n for cap in caps])
    mrc = lru_mrc(dense)
    all_caps = sorted({int(x) for x in np.unique(np.geomspace(1, max(caps), 64).astype(np.int64))})
    curves["lru-mrc (per access)"] = (all_caps, [float(x) for x in mrc.miss_ratio(np.array(all_caps))])
    return curves


def _need_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingDependencyError("hiermem tune plots with matplotlib, which is not installed: "
                                     "pip install 'hiermem[tune]'") from e
    return plt


#: One colour per policy family, the same in every plot.
POLICY_COLOURS = {"lru": "tab:blue", "lfu": "tab:orange", "lfu_decay": "tab:green", "lookahead": "tab:red",
                  "sieve": "tab:purple", "s3fifo": "tab:brown", "arc": "tab:pink", "wtinylfu": "tab:olive",
                  "belady": "black", "lru-mrc": "tab:gray"}


def plot_curves(curves: dict, path: Path, title: str, chosen: tuple[int, str] | None = None) -> Path:
    """Miss ratio vs device rows (log x) for every curve, to a PNG; ``chosen`` = (device
    rows, curve family) marks the winner's size on its family's curve."""
    plt = _need_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name, (caps, ratios) in curves.items():
        style = "--" if "per access" in name else "-o"
        fam = name.split(" ", 1)[0]
        ax.plot(caps, ratios, style, label=name, markersize=3, color=POLICY_COLOURS.get(fam))
    if chosen is not None:
        rows, fam = chosen
        for name, (caps, ratios) in curves.items():
            if name.split(" ", 1)[0] == fam:
                y = float(np.interp(np.log(rows), np.log(caps), ratios))
                ax.plot([rows], [y], "*", markersize=14, color=POLICY_COLOURS.get(fam, "black"),
                        markeredgecolor="black", label=f"chosen: {fam}, {rows} device rows", zorder=5)
                break
        ax.axvline(rows, color="black", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("device rows")
    ax.set_ylabel("device miss ratio")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else "nan"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_policy_file(path: Path, s: Scored, trace: Trace) -> Path:
    """The winner as a policy file (keys that :func:`~hiermem.core.policies.resolve_policy` reads)."""
    c = s.candidate
    desc = (f"tuned by hiermem tune on {trace.path.name}: device hit rate {s.hit_rate:.4f}, "
            f"est. step {1e3 * s.step_seconds:.3f} ms")
    if PolicySpec(c.policy).build(1, "cpu").wants_lookahead:
        desc += "; needs on_lookahead calls from the prefetch pipeline (plain LRU without them)"
    lines = [f"# {c.label}", f"name = {_toml_value(c.policy)}", f"description = {_toml_value(desc)}",
             f"device_rows = {c.device_rows}", f"host_rows = {c.host_rows}", f"prefetch_depth = {c.prefetch_depth}"]
    if c.params:
        lines.append("[params]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in c.params]
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def tune(trace: Trace | str | os.PathLike, cfg: TuneConfig, out_dir: str | os.PathLike = "policies",
         name: str = "tuned", plot: str | os.PathLike | None = None, progress: bool = True,
         write: bool = True) -> TuneResult:
    """Search ``cfg``'s space on ``trace``; write ``<out_dir>/<name>.toml`` and the plot.

    Raises:
        MissingDependencyError: matplotlib is missing (``pip install 'hiermem[tune]'``).
        TraceFormatError: ``trace`` is not a trace.
    """
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise InvalidArgumentError(f"name must be a plain file name, got {name!r}")
    if write:
        _need_matplotlib()  # fail before the search, not after
    trace = trace if isinstance(trace, Trace) else load_trace(trace)
    cands = candidates(cfg, trace.accesses)
    scored = []
    for i, c in enumerate(cands):
        _progress(i, len(cands), c.label, progress)
        r = simulate(trace, SimConfig(c.device_rows, c.host_rows, c.spec, c.prefetch_depth,
                                      row_bytes=cfg.row_bytes, cost=cfg.cost))
        scored.append(_score(c, r))
    _progress(len(cands), len(cands), "done", progress)
    ranked = rank(scored)
    result = TuneResult(ranked, _curves(trace, ranked, cfg, progress), trace.accesses)
    if write:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        result.policy_file = write_policy_file(out / f"{name}.toml", ranked[0], trace)
        png = Path(plot) if plot is not None else out / f"{name}.png"
        w = ranked[0].candidate
        result.plot_file = plot_curves(result.curves, png, f"{trace.path.name}: device miss ratio",
                                       chosen=(w.device_rows, w.policy))
    return result
