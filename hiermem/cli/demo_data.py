"""The demo's data sources and held-out metrics (log loss, AUC).

Three sources, each a pure function of the step, so a resumed run sees exactly the
batches it would have seen:

* ``criteo-dac-head8k``: the real Criteo rows in the shared data folder (``train.csv``,
  ``dev.csv``, ``test.csv``, read in place).  Training goes by epochs over ``train.csv``
  (each epoch a seeded permutation); ``dev.csv`` and ``test.csv`` are held out.
* ``criteo:PATH``: any Criteo-layout TSV (streamed ``batch`` lines at a time, cycled); no
  held-out split.
* ``synthetic``: :class:`~hiermem.nn.data.CriteoLike`; the held-out splits are batches of the
  same generator far beyond any training step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..nn.data import CriteoLike, criteo_tsv_batches, parse_criteo_lines, shared_data_dir
from ..errors import HierMemError

REAL = "criteo-dac-head8k"
SYNTHETIC = "synthetic"
_HELD_OUT = 1 << 40  # synthetic held-out batches start here (dev) and at twice this (test)
_HELD_OUT_BATCHES = 4


def real_data_dir() -> Path | None:
    """The shared Criteo folder when its three splits are present."""
    d = shared_data_dir()
    f = d / REAL if d else None
    if f is not None and all((f / n).is_file() for n in ("train.csv", "dev.csv", "test.csv")):
        return f
    return None


def choose(synthetic: bool, criteo: str | None) -> str:
    """The data source's name for these flags (``criteo:PATH``, the real rows, or synthetic)."""
    if criteo:
        p = Path(criteo)
        if not p.is_file():
            raise HierMemError(f"--criteo {criteo}: no such Criteo TSV file")
        return f"criteo:{p.absolute()}"
    if not synthetic and real_data_dir() is not None:
        return REAL
    return SYNTHETIC


def _read(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
    return parse_criteo_lines(lines, str(path))


@dataclass
class Source:
    """Training batches by step, plus held-out splits (``None`` where there are none)."""

    name: str
    batch: int
    seed: int
    train: tuple | None = None  # (labels, dense, cats) of the real rows
    dev: tuple | None = None
    test: tuple | None = None
    _gen: CriteoLike | None = None

    @classmethod
    def open(cls, name: str, batch: int, seed: int) -> "Source":
        if name == REAL:
            d = real_data_dir()
            if d is None:
                raise HierMemError(f"the run trained on {REAL}, which is not in the shared data folder "
                                   "(../shared/data or $HIERMEM_DATA)")
            return cls(name, batch, seed, _read(d / "train.csv"), _read(d / "dev.csv"), _read(d / "test.csv"))
        if name == SYNTHETIC:
            gen = CriteoLike(batch, seed=seed)
            held = [_cat([gen.batch_at(base + k) for k in range(_HELD_OUT_BATCHES)])
                    for base in (_HELD_OUT, 2 * _HELD_OUT)]
            return cls(name, batch, seed, dev=held[0], test=held[1], _gen=gen)
        if name.startswith("criteo:"):
            if not Path(name[7:]).is_file():
                raise HierMemError(f"the run's Criteo file {name[7:]} is gone")
            return cls(name, batch, seed)
        raise HierMemError(f"unknown demo data source {name!r}")

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps in one pass over ``train.csv`` (``None`` for streams)."""
        return None if self.train is None else -(-len(self.train[0]) // self.batch)

    @property
    def train_rows(self) -> int | None:
        return None if self.train is None else len(self.train[0])

    def batches(self, start: int):
        """``(labels, dense, cats)`` numpy batches from step ``start`` on (endless)."""
        if self.train is not None:
            return self._epochs(start)
        if self._gen is not None:
            return (self._gen.batch_at(s) for s in range(start, 1 << 62))
        return criteo_tsv_batches(self.name[7:], self.batch, start_batch=start)

    def _epochs(self, start: int):
        n, spe = len(self.train[0]), self.steps_per_epoch
        step = start
        while True:
            e, i = divmod(step, spe)
            perm = np.random.default_rng([self.seed, e]).permutation(n)
            idx = perm[i * self.batch:(i + 1) * self.batch]
            yield tuple(a[idx] for a in self.train)
            step += 1

    def held_out(self, split: str):
        """``(labels, dense, cats)`` batches of ``split`` ("dev" or "test"), or ``None``."""
        data = getattr(self, split)
        if data is None:
            return None
        return [tuple(a[i:i + self.batch] for a in data) for i in range(0, len(data[0]), self.batch)]


def _cat(parts):
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))


def log_loss(y: np.ndarray, p: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities ``p`` (clipped to 1e-7) against labels ``y``."""
    p = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def auc(y: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC (Mann-Whitney U, ties counted half); ``nan`` when one class is absent."""
    y = np.asarray(y) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    s = np.asarray(score)[order]
    ranks = np.empty(len(s), dtype=np.float64)
    # average ranks over runs of equal scores
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    avg = (starts + ends + 1) / 2.0  # ranks are 1-based
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))
