"""A small DLRM (bottom MLP, embedding bags, dot interaction, top MLP) and Criteo plumbing.

Used by ``hiermem demo``, the tests and ``scripts/bench_train.py``.  The embedding part
is any module mapping :class:`SparseFeatures` to ``[B, tables * dim]``: a
:class:`~hiermem.CachedEmbeddingBagCollection`, or :class:`PlainEmbeddingBags` (plain
``nn.EmbeddingBag`` tables, the in-memory reference).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from .data import NUM_CAT, NUM_DENSE
from .features import SparseFeatures
from ..core.hashing import mix64, mix_scalar
from ..types import TableSpec


def criteo_tables(rows_per_table: int, dim: int = 16, unbounded: Sequence[int] = (2, 3, 11, 15, 20, 23)
                  ) -> list[TableSpec]:
    """26 tables ``C1..C26``: bounded ones of ``rows_per_table`` hashed rows, and
    ``num_rows=None`` ones (64-bit hashed ids) for the fields in ``unbounded``."""
    return [TableSpec(f"C{j + 1}", None if j in unbounded else rows_per_table, dim) for j in range(NUM_CAT)]


def criteo_features(cats: np.ndarray, tables: Sequence[TableSpec], salt: int = 0) -> SparseFeatures:
    """Raw categorical values ``[B, 26]`` (-1 = missing) -> one id per present value.

    Values are hashed with ``(salt, field)`` into each table's id space (modulo
    ``num_rows`` for bounded tables, a non-negative int64 for unbounded ones); a missing
    value is an empty bag.  Vectorised over the whole batch.
    """
    c = torch.from_numpy(np.ascontiguousarray(cats.T, dtype=np.int64))  # [26, B], key-major
    present = c >= 0
    keys = torch.tensor([mix_scalar(salt, j) for j in range(c.shape[0])], dtype=torch.int64).unsqueeze(1)
    h = mix64(c ^ keys) & ((1 << 63) - 1)
    mod = torch.tensor([s.num_rows or 0 for s in tables], dtype=torch.int64).unsqueeze(1)
    ids = torch.where(mod > 0, h % mod.clamp(min=1), h)
    return SparseFeatures(tuple(s.name for s in tables), ids[present], present.reshape(-1).to(torch.int64))


class PlainEmbeddingBags(nn.Module):
    """In-memory reference: one ``nn.EmbeddingBag(sparse=True)`` per (bounded) table."""

    def __init__(self, tables: Sequence[TableSpec], mode: str = "sum"):
        super().__init__()
        self.names = [s.name for s in tables]
        self.bags = nn.ModuleDict({s.name: nn.EmbeddingBag(s.num_rows, s.dim, mode=mode, sparse=True)
                                   for s in tables})

    def forward(self, f: SparseFeatures) -> torch.Tensor:
        d = f.to_dict()
        return torch.cat([self.bags[n](d[n][0], d[n][1], per_sample_weights=d[n][2]) for n in self.names], 1)


def _mlp(sizes: Sequence[int], last_act: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM: ``top(cat(bottom(dense), pairwise dots of [bottom, embeddings]))`` -> logit.

    Args:
        embeddings: module ``SparseFeatures -> [B, T * dim]`` (all tables of one dim).
        num_tables: ``T``.
        dim: embedding dimension (the bottom MLP's output size).
        dense_in: dense features (13 for Criteo).
        bottom, top: hidden sizes of the MLPs.
    """

    def __init__(self, embeddings: nn.Module, num_tables: int, dim: int, dense_in: int = NUM_DENSE,
                 bottom: Sequence[int] = (64,), top: Sequence[int] = (64,)):
        super().__init__()
        self.embeddings = embeddings
        self.T, self.dim = num_tables, dim
        self.bottom = _mlp([dense_in, *bottom, dim], last_act=True)
        n = num_tables + 1
        self.register_buffer("_pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = _mlp([dim + n * (n - 1) // 2, *top, 1], last_act=False)

    def dense_parameters(self):
        """Parameters of the MLPs (the embeddings train through their own optimizer)."""
        return [p for name, p in self.named_parameters() if not name.startswith("embeddings.")]

    def forward(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        x = self.bottom(dense)
        e = self.embeddings(sparse).view(-1, self.T, self.dim)
        z = torch.cat((x.unsqueeze(1), e), 1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat((x, dots), 1)).squeeze(1)
