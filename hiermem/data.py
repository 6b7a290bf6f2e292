"""Access traces for demos, tests and benchmarks: a seeded bounded Zipf generator and
readers of the real logs in ``../shared/data`` (read in place, never copied)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class ZipfIds:
    """Ids ``0..num_rows-1`` drawn with ``P(rank r) ~ r**-alpha`` (bounded, any alpha > 0).

    Ranks are scattered over the id space by a fixed random permutation (a multiplicative
    hash for large tables), so hot ids are not simply the small ones.

    Args:
        num_rows: size of the id space.
        alpha: Zipf exponent (1.05 is typical of recommendation logs).
        seed: fixes both the permutation and the draws.
    """

    def __init__(self, num_rows: int, alpha: float = 1.05, seed: int = 0):
        if num_rows <= 0 or alpha <= 0:
            raise ValueError("num_rows and alpha must be > 0")
        self.num_rows = int(num_rows)
        self.alpha = float(alpha)
        w = np.arange(1, self.num_rows + 1, dtype=np.float64) ** -self.alpha
        self._cdf = np.cumsum(w)
        self._cdf /= self._cdf[-1]
        self._rng = np.random.default_rng(seed)
        # an odd multiplier modulo a power of two is a bijection; fold into [0, num_rows)
        self._mult = int(self._rng.integers(1 << 20, 1 << 40)) | 1
        self._offset = int(self._rng.integers(0, self.num_rows))

    def ranks(self, n: int) -> np.ndarray:
        return np.searchsorted(self._cdf, self._rng.random(n), side="right").clip(max=self.num_rows - 1)

    def __call__(self, n: int) -> np.ndarray:
        """``n`` ids as int64."""
        r = self.ranks(n).astype(np.int64)
        return (r * self._mult + self._offset) % self.num_rows


def shared_data_dir() -> Path | None:
    """``../shared/data`` next to the checkout (or ``$HIERMEM_DATA``), if present."""
    env = os.environ.get("HIERMEM_DATA")
    cands = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent
    cands += [here.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in cands:
        if c.is_dir():
            return c
    return None


def criteo_cat_ids() -> np.ndarray | None:
    """``criteo-dac-head8k/cat_ids.npy``: int32 ``[7200, 26]`` (-1 = missing), or None."""
    d = shared_data_dir()
    f = d / "criteo-dac-head8k" / "cat_ids.npy" if d else None
    if f is None or not f.is_file():
        return None
    return np.load(f, allow_pickle=False)


def criteo_global_stream() -> np.ndarray | None:
    """The Criteo head's (field, value) pairs as one id stream (per-field offsets, row-major,
    missing values dropped): the lookup order a DLRM batch issues."""
    ids = criteo_cat_ids()
    if ids is None:
        return None
    ids = ids.astype(np.int64)
    card = ids.max(axis=0) + 1
    offs = np.concatenate(([0], np.cumsum(card)[:-1]))
    g = ids + offs
    return g[ids >= 0]
