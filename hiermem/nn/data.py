"""Access traces for demos, tests and benchmarks: a seeded bounded Zipf generator and
readers of the real logs in ``../shared/data`` (read in place, never copied)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import HierMemError


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
    checkout = Path(__file__).resolve().parents[2]  # hiermem/nn/data.py -> the checkout
    cands += [checkout.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
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


# -- Criteo-layout batches for DLRM training -----------------------------------------------
NUM_DENSE, NUM_CAT = 13, 26
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


class CriteoFormatError(HierMemError, ValueError):
    """A line that is not in Criteo's TSV layout (label, 13 integers, 26 hex hashes)."""


def parse_criteo_lines(lines: list[bytes], path: str = "<lines>") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Criteo TSV lines -> ``(labels float32 [n], dense float32 [n, 13], cats int64 [n, 26])``.

    Vectorised: the fields of all lines are split at once and the 8-hex-digit hashes are
    decoded through a byte table.  Missing integers are 0; missing hashes are -1.  Dense
    values get DLRM's ``log(1 + max(x, 0))``.
    """
    n = len(lines)
    fields = b"\t".join(ln.rstrip(b"\r\n") for ln in lines).split(b"\t")
    if len(fields) != n * (1 + NUM_DENSE + NUM_CAT):
        raise CriteoFormatError(f"{path}: expected {1 + NUM_DENSE + NUM_CAT} tab-separated fields per line")
    a = np.array(fields).reshape(n, 1 + NUM_DENSE + NUM_CAT)  # sized to the longest field: nothing cut
    try:  # integers, as Criteo writes them ("nan", "1e5" or 30 digits are not)
        labels = a[:, 0].astype(np.int64)
        num = a[:, 1:1 + NUM_DENSE]
        dense = np.where(num == b"", b"0", num).astype(np.int64)
    except (ValueError, OverflowError) as e:
        raise CriteoFormatError(f"{path}: a label or integer field is not an integer ({e})") from None
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise CriteoFormatError(f"{path}: a label is not 0 or 1")
    labels = labels.astype(np.float32)
    dense = np.log1p(np.maximum(dense, 0).astype(np.float64)).astype(np.float32)
    cat = a[:, 1 + NUM_DENSE:]
    if a.dtype.itemsize > 8 and bool((np.char.str_len(cat) > 8).any()):
        raise CriteoFormatError(f"{path}: a categorical field is not 8 hex digits")
    missing = cat == b""
    raw = np.frombuffer(np.where(missing, b"00000000", cat).astype("S8").tobytes(), dtype=np.uint8)
    nib = _HEX[raw].reshape(n, NUM_CAT, 8)
    if bool((nib == 255).any()):
        raise CriteoFormatError(f"{path}: a categorical field is not 8 hex digits")
    weights = (16 ** np.arange(7, -1, -1)).astype(np.int64)
    cats = (nib.astype(np.int64) * weights).sum(-1)
    cats[missing] = -1
    return labels, dense, cats


def criteo_tsv_batches(path, batch: int, start_batch: int = 0, cycle: bool = True):
    """Stream ``(labels, dense, cats)`` batches from a Criteo-layout TSV file.

    Reads ``batch`` lines at a time (the file is never loaded whole); with ``cycle`` it
    starts over at the end, so a few hundred steps run on a small file.  ``start_batch``
    skips that many batches first (resuming a run).
    """
    path = Path(path)
    skip = start_batch * batch
    buf: list[bytes] = []  # kept across passes: a file shorter than a batch wraps around
    while True:
        got_any = False
        try:
            f = open(path, "rb")
        except OSError as e:  # missing, a directory, unreadable
            raise CriteoFormatError(f"{path}: cannot read the Criteo file: {e.strerror or e}") from e
        with f:
            for line in f:
                if not line.strip():
                    continue
                got_any = True
                if skip:
                    skip -= 1
                    continue
                buf.append(line)
                if len(buf) == batch:
                    yield parse_criteo_lines(buf, str(path))
                    buf = []
        if not got_any:
            raise CriteoFormatError(f"{path}: no Criteo lines")
        if not cycle:
            if buf:
                yield parse_criteo_lines(buf, str(path))
            return


class CriteoLike:
    """A seeded synthetic generator of Criteo-like batches (13 dense, 26 categorical).

    Field ``j`` draws Zipf(``alpha``) ids over ``cardinalities[j]`` values; the label
    follows a fixed hidden logistic model of the dense features and of a per-value
    effect of the first fields, so a model can learn it.  ``batch_at(step)`` is a pure
    function of ``(seed, step)``: resuming at any step sees the same data.
    """

    def __init__(self, batch: int = 256, seed: int = 0, alpha: float = 1.05,
                 cardinalities: tuple[int, ...] | None = None):
        self.batch, self.seed, self.alpha = int(batch), int(seed), float(alpha)
        rng = np.random.default_rng(seed)
        self.cardinalities = tuple(cardinalities) if cardinalities else \
            tuple(int(c) for c in np.geomspace(10, 2_000_000, NUM_CAT).round())
        self._zipf = [ZipfIds(c, alpha, seed=seed * 1000 + j) for j, c in enumerate(self.cardinalities)]
        self._w = rng.normal(0, 0.5, NUM_DENSE).astype(np.float32)
        self._salt = int(rng.integers(1, 2**62))

    def batch_at(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(step)])
        for j, z in enumerate(self._zipf):
            z._rng = np.random.default_rng([self.seed, int(step), j])
        cats = np.stack([z(self.batch) for z in self._zipf], 1).astype(np.int64)
        dense = np.log1p(rng.exponential(3.0, (self.batch, NUM_DENSE))).astype(np.float32)
        effect = ((cats[:, :4] * 2654435761 + self._salt) % 1000 / 1000.0 - 0.5).sum(1)
        logit = dense @ self._w - 1.0 + 2.0 * effect
        labels = (rng.random(self.batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return labels, dense, cats

    def __iter__(self):
        step = 0
        while True:
            yield self.batch_at(step)
            step += 1
