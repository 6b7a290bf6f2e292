"""A validated, deduplicated batch (:class:`Batch`) and where its rows sit once placed
(:class:`Placement`): what the store's placement hands the data plane.

``dedup`` and ``runs`` build a batch's sorted runs (one compiled radix sort on the CPU,
:mod:`hiermem.dataplane.batch`; two stable torch sorts elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..dataplane.batch import sorted_runs


@dataclass
class Placement:
    """Where the distinct rows of a batch sit after :meth:`~hiermem.store.residency.Residency.resolve`
    (CPU tensors: the control plane's answer)."""

    on_device: torch.Tensor | None  # bool [U] (None: all on device)
    slot: torch.Tensor  # int64 [U], a slot of the device or host tier
    was_on_device: torch.Tensor | None = None  # bool [U]: on the device before the resolve (None: all)
    dev: SimpleNamespace | None = None  # the same on the store's device, staged (hiermem.store.staged.StagedPath.stage)


@dataclass
class Batch:
    """A validated, deduplicated batch of keys of one or more tables."""

    t: torch.Tensor  # int64 [U] table index of each distinct key
    k: torch.Tensor  # int64 [U] ids
    inverse: torch.Tensor  # int64 [n] position of each input id in (t, k)
    counts: torch.Tensor  # int64 [U] occurrences
    lastpos: torch.Tensor  # int64 [U] position of the last occurrence
    n: int
    perm: torch.Tensor | None = None  # int64 [n] input positions in (t, k) order, stable
    starts: torch.Tensor | None = None  # int64 [U] where each distinct key's run starts in perm

    def sum_rows(self, src: torch.Tensor, index: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """Per distinct key, the sum over its occurrences ``j`` of ``src[index[j]] * weights[j]``
        (``src[j]`` when ``index`` is None): ``[U, cols]`` float32.

        One fused ``embedding_bag`` over the runs of the sorted order (no ``[n, cols]``
        intermediate, and far faster than ``index_add_`` on CPU); occurrences add up in
        input order, as ``index_add_`` would add them.
        """
        src = src.detach()
        dd = src.device  # the batch's own tensors are on the CPU (copied here when src is not)
        if index is not None:
            index = index.to(dd)
        if weights is not None:
            weights = weights.detach().to(dd)
        if self.perm is None:  # a batch built without its sort (a sub-batch)
            rows = src if index is None else src.index_select(0, index)
            if weights is not None:
                rows = rows * weights.unsqueeze(1)
            out = torch.zeros((self.k.numel(), src.shape[1]), dtype=src.dtype, device=dd)
            return out.index_add_(0, self.inverse.to(dd), rows)
        perm = self.perm.to(dd)
        idx = perm if index is None else index.index_select(0, perm)
        w = None if weights is None else weights.to(src.dtype).index_select(0, perm)
        return F.embedding_bag(idx, src, self.starts.to(dd), mode="sum", per_sample_weights=w)


def dedup(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(unique, inverse, counts, lastpos, perm, starts)`` of int64 keys ``x`` from one
    stable sort (``torch.unique`` sorts too, but returns neither the order nor the last
    occurrence, which then costs a scatter).  On the CPU one compiled radix sort and a
    pass over its runs give the same tensors (:mod:`hiermem.dataplane.dedup`)."""
    if x.device.type == "cpu":
        perm, starts, inverse, counts, lastpos, u, _ = sorted_runs(x)
        return u, inverse, counts, lastpos, perm, starts
    s, perm = torch.sort(x, stable=True)
    starts, inverse, counts, lastpos = runs(perm, s[1:] != s[:-1])
    return s.index_select(0, starts), inverse, counts, lastpos, perm, starts


def runs(perm: torch.Tensor, differs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(starts, inverse, counts, lastpos)`` of the runs of equal keys in a stable sort
    ``perm`` of the input, whose sorted neighbours differ where ``differs [n-1]``."""
    n = perm.numel()
    new = torch.ones(n, dtype=torch.bool, device=perm.device)
    new[1:] = differs
    starts = new.nonzero().squeeze(1)
    ends = torch.empty_like(starts)
    if starts.numel():
        ends[:-1] = starts[1:]
        ends[-1] = n
    inverse = torch.empty_like(perm).scatter_(0, perm, torch.cumsum(new, 0) - 1)
    # in a stable sort the last of a run is the key's last occurrence in the input
    return starts, inverse, ends - starts, perm.index_select(0, ends - 1)
