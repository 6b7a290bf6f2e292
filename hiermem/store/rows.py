"""The record of a row never written: its deterministic initial value.

A row's record is its weights (``dim`` floats) followed by its optimizer state.  A row no
tier holds and LMDB never received takes its initial record from a counter-based hash of
``(seed, table, id)``: the same value in every process, at any time, so a row can be
created lazily where it is first used (a store, a read-only reader, a shard).
"""

from __future__ import annotations

import torch

from ..core.hashing import mix_scalar, uniform_rows
from ..dataplane.optim import Optimizer
from ..types import TableSpec


def initial_records(spec: TableSpec, table_index: int, seed: int, optimizer: Optimizer,
                    ids: torch.Tensor) -> torch.Tensor:
    """Records ``[n, dim + state]`` of rows never written: weights ``U[-bound, bound)`` from
    a counter-based hash of ``(seed, table, id)``, optimizer state at its initial value."""
    key = mix_scalar(seed, table_index, spec.num_rows or 0, spec.dim)
    rec = torch.full((ids.numel(), spec.dim + optimizer.state_width(spec.dim)), optimizer.state_init(),
                     dtype=torch.float32, device=ids.device)
    rec[:, :spec.dim] = uniform_rows(key, ids, spec.dim, spec.bound)
    return rec
