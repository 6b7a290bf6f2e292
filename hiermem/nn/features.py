"""SparseFeatures: a batch of jagged id lists per feature, in TorchRec's KeyedJaggedTensor layout.

``values`` holds every id of the batch grouped by key, then by sample: for keys
``[k0, k1]`` and batch size ``B``, ``lengths[:B]`` are the bag sizes of ``k0``'s samples
and ``lengths[B:]`` those of ``k1``; ``values`` is ``k0``'s ids of sample 0, 1, ...,
then ``k1``'s.  ``weights`` (optional) are per-id weights aligned with ``values``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class SparseFeatures:
    """Ids of ``len(keys)`` features for a batch of ``B`` samples (jagged, KJT layout).

    Args:
        keys: feature names, one per table of the collection that reads them.
        values: int64 ids ``[sum(lengths)]``, grouped by key then sample.
        lengths: int ``[len(keys) * B]``, the bag size of each (key, sample).
        weights: optional float per-id weights ``[sum(lengths)]``.

    Raises:
        InvalidTypeError, InvalidArgumentError: the parts do not fit together.
    """

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        keys = tuple(self.keys) if not isinstance(self.keys, str) else None
        if not keys or not all(isinstance(k, str) for k in keys):
            raise InvalidTypeError("keys must be a non-empty sequence of feature names")
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError(f"duplicate keys in {list(keys)}")
        object.__setattr__(self, "keys", keys)
        for name in ("values", "lengths"):
            v = getattr(self, name)
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.is_floating_point() or v.is_complex() \
                    or v.dtype == torch.bool:
                raise InvalidTypeError(f"{name} must be a 1-D integer tensor")
        if self.lengths.numel() % len(keys):
            raise InvalidArgumentError(f"lengths has {self.lengths.numel()} entries, not a multiple of "
                                       f"{len(keys)} keys")
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            raise InvalidArgumentError("lengths must be >= 0")
        total = int(self.lengths.sum()) if self.lengths.numel() else 0
        if total != self.values.numel():
            raise InvalidArgumentError(f"lengths add up to {total} but there are {self.values.numel()} values")
        if self.weights is not None:
            w = self.weights
            if not isinstance(w, torch.Tensor) or not w.is_floating_point() or tuple(w.shape) != (total,):
                raise InvalidArgumentError(f"weights must be a float tensor of shape ({total},)")

    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys)

    def key_lengths(self) -> torch.Tensor:
        """Number of ids per key ``[len(keys)]``."""
        return self.lengths.view(len(self.keys), -1).sum(1) if self.batch_size else \
            torch.zeros(len(self.keys), dtype=torch.int64)

    def offsets(self) -> torch.Tensor:
        """Start of every (key, sample) bag in ``values``: ``[len(keys) * B + 1]``."""
        z = torch.zeros(1, dtype=torch.int64, device=self.lengths.device)
        return torch.cat((z, torch.cumsum(self.lengths.to(torch.int64), 0)))

    def to_dict(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """``{key: (values, offsets [B], weights or None)}`` per key, ``nn.EmbeddingBag`` style."""
        B = self.batch_size
        kl = self.key_lengths().tolist()
        vals = torch.split(self.values, kl)
        wts = torch.split(self.weights, kl) if self.weights is not None else [None] * len(kl)
        lens = self.lengths.to(torch.int64).view(len(self.keys), B) if B else \
            torch.zeros((len(self.keys), 0), dtype=torch.int64)
        out = {}
        for i, k in enumerate(self.keys):
            off = torch.cumsum(lens[i], 0) - lens[i]
            out[k] = (vals[i], off, wts[i])
        return out

    @classmethod
    def from_dict(cls, bags: Mapping[str, Sequence[Sequence[int]]]) -> "SparseFeatures":
        """From ``{key: [[ids of sample 0], [ids of sample 1], ...]}`` (same batch size per key)."""
        keys = list(bags)
        sizes = {len(v) for v in bags.values()}
        if len(sizes) > 1:
            raise InvalidArgumentError(f"every key needs the same batch size, got {sorted(sizes)}")
        lengths = [len(s) for k in keys for s in bags[k]]
        values = [int(i) for k in keys for s in bags[k] for i in s]
        return cls(tuple(keys), torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))

    @classmethod
    def from_kjt(cls, kjt) -> "SparseFeatures":
        """From a ``torchrec.KeyedJaggedTensor`` (same layout; weights carried over)."""
        return cls(tuple(kjt.keys()), kjt.values(), kjt.lengths(), kjt.weights_or_none())

    def to(self, device) -> "SparseFeatures":
        w = None if self.weights is None else self.weights.to(device)
        return SparseFeatures(self.keys, self.values.to(device), self.lengths.to(device), w)
