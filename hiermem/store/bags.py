"""Pooled bags over several tables: the store's multi-table lookup and its fused backward.

A collection (:class:`~hiermem.nn.modules.CachedEmbeddingBagCollection`) looks up every
table of a step in one :meth:`BagOps.lookup`: the ids come with their table indices,
are validated and deduplicated once (:class:`~hiermem.store.multi.MultiIds`), placed by the
store (or found pinned by their prefetch ticket) and pooled by the data plane in one
op.  :meth:`BagOps.update` is the backward fused with the optimizer: given the same
tensors as the lookup before it, it reuses that lookup's validation, dedup and
placement (the memo), and each distinct row takes one optimizer step in place in its
tier, with no dense gradient.

:class:`BagOps` is a part of a :class:`~hiermem.store.HierarchicalStore`, called with
the store's lock held; the store's ``lookup_bags`` / ``update_bags`` are its API.
"""

from __future__ import annotations

import torch

from .multi import BagMemo, MultiIds, Place, Prefetches, ReadyBags, Ticket, bags_of, offsets_of, ticket_batch
from .placed import Batch, Placement
from ..dataplane import PlaneView
from ..dataplane.batch import tables_present
from ..errors import InvalidArgumentError
from ..observe.stats import Counters, IO


class BagOps:
    """The multi-table pooled ops of a store, over the parts of it they need.

    Args:
        view: what the data plane reads of the store (residency, optimizer, dims, widths,
            the optimizer step per table: shared, counted here, and the device).
        counters: the store's counters.
        multi: the store's validation and dedup of multi-table batches.
        prefetches: the store's prefetch tickets and pins.
        place: the store's accounted placement of a batch (``place(b, account, ...)``).
    """

    def __init__(self, view: PlaneView, counters: Counters, multi: MultiIds, prefetches: Prefetches, place: Place):
        self.view, self.counters, self.multi, self.prefetches, self.place = view, counters, multi, prefetches, place
        self.steps = view.steps
        self.max_dim = int(view.dims.max())
        self.memo: BagMemo | None = None  # the last lookup, reused by the update that follows it

    def lookup(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mode: str,
               per_sample_weights: torch.Tensor | None, ticket: Ticket | None,
               samples: int | None = None) -> torch.Tensor:
        """:meth:`HierarchicalStore.lookup_bags <hiermem.store.HierarchicalStore.lookup_bags>`."""
        view, res = self.view, self.view.residency
        staged = res.staged
        b = ticket_batch(ticket, tables, ids)
        if b is None:
            t, k = self.multi.ids(tables, ids)
        n = k.numel() if b is None else b.n
        offsets_in = offsets
        ready = ticket.bags if b is not None else None
        if ready is not None and ready.matches(offsets, mode, per_sample_weights, samples):
            offsets, bag, scale = ready.offsets, ready.bag, ready.scale
        else:
            offsets = offsets_of(n, offsets)
            bag, scale = bags_of(n, offsets, mode, per_sample_weights, view.device, samples)
        D = self.max_dim
        if n == 0:
            nb = offsets.numel()
            shape = (nb, D) if samples is None else (samples, nb // samples * D)
            return torch.zeros(shape, dtype=torch.float32, device=view.device)
        prefetched = b is not None
        b = self.multi.batch(t, k) if b is None else b
        extra = staged.extras(b, offsets, bag, scale)
        if prefetched and ticket.pinned and not ticket.released and ticket.slots is not None:
            # pinned on the device by its prefetch: rows stay put
            self.counters.add_io(IO.PREFETCH_HITS, n)
            p = Placement(None, ticket.slots)
        else:
            p = self.prefetches.place_batch(b, ticket, extra, self.place)
        staged.staged(b, p, extra)  # the plan's, the placement's and the step's arrays: one copy
        self.memo = BagMemo(ids, ids._version, tables, tables._version, offsets_in, mode, per_sample_weights, b, p,
                            res.epoch, ticket, bag, scale, offsets.numel(), samples)
        return res.plane.pool(view, p, b.inverse, offsets, n, D, mode,
                              None if per_sample_weights is None else scale, samples)

    def prepare(self, n: int, offsets: torch.Tensor, mode: str, per_sample_weights: torch.Tensor | None,
                samples: int | None = None) -> ReadyBags:
        """The bags of a lookup of ``n`` ids, validated ahead of it (see :class:`ReadyBags`)."""
        o = offsets_of(n, offsets)
        bag, scale = bags_of(n, o, mode, per_sample_weights, self.view.device, samples)
        return ReadyBags(offsets, offsets._version, mode, per_sample_weights, o, bag, scale, samples)

    def update(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, mode: str,
               per_sample_weights: torch.Tensor | None, ticket: Ticket | None, stepped: list[int] | None,
               samples: int | None = None, grad_owned: bool = False) -> None:
        """:meth:`HierarchicalStore.update_bags <hiermem.store.HierarchicalStore.update_bags>`."""
        view, res = self.view, self.view.residency
        m = self.memo
        if m is not None and m.matches(ids, tables, offsets, mode, per_sample_weights, samples):
            b, bag, scale, nbags = m.b, m.bag, m.scale, m.nbags
            p = m.p if m.placement_valid(res.epoch, ticket) else None
            if p is None and ticket is not None and ticket.pinned and not ticket.released:
                p = res.locate(b)  # its rows are pinned where they are
            t = k = None
        else:
            t, k = self.multi.ids(tables, ids)
            offsets = offsets_of(k.numel(), offsets)
            bag, scale = bags_of(k.numel(), offsets, mode, per_sample_weights, view.device, samples)
            b, p, nbags = None, None, offsets.numel()
        D = self.max_dim
        shape = (nbags, D) if samples is None else (samples, nbags // samples * D)
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point() or tuple(grad.shape) != shape:
            raise InvalidArgumentError(f"grad must be a float tensor of shape {shape}")
        if bag.numel() == 0:
            for ti in stepped or ():
                self.steps[ti] += 1
            return
        if b is None:
            b = self.multi.batch(t, k)
            p = res.locate(b) if ticket is not None and ticket.pinned else None
        # each distinct row's gradient: the sum over its ids of their bag's gradient
        # (times the id's scale), formed by the data plane; with samples, ``bag`` holds
        # each id's bag's row of the sample-major grad viewed [nbags, D]
        if grad.requires_grad:  # (each torch op lets a background thread take the GIL: none needless)
            grad = grad.detach()
        if grad.device != view.device:
            grad = grad.to(view.device)
        if samples is not None:
            grad = grad.reshape(nbags, D)
        self.apply(b, p, grad, bag, scale, stepped, grad_owned)

    def apply(self, b: Batch, p: Placement | None, grad: torch.Tensor, bag: torch.Tensor,
              scale: torch.Tensor | None, stepped: list[int] | None = None, grad_owned: bool = False) -> None:
        """Apply the gradients of bags ``grad`` to the rows of batch ``b`` (placement ``p``,
        None: place it now): one optimizer step per distinct row, in place in its tier
        (perhaps on the store's apply worker: see :mod:`hiermem.dataplane.deferred`).
        ``grad_owned``: nobody writes ``grad`` after the call (autograd's gradient)."""
        view, res = self.view, self.view.residency
        staged = res.staged
        staged.check_deferred()
        rg = staged.row_grads(b, p, grad, bag, scale)
        rg.owned = grad_owned or rg.grad is not grad  # (row_grads made a float32/contiguous copy)
        res.plane.check(rg, "gradients")
        if p is None:
            p = self.prefetches.retry(lambda: self.place(b, account=False))  # under the store's lock
        if staged.active and p.dev is None:  # located, not placed: its slots to the device
            p.dev = staged.stage(b, p)
        t = b.t if b.t.is_contiguous() else b.t.contiguous()
        present = tables_present(t.numpy(), len(view.dims)).tolist()  # one compiled pass
        steps = sorted(set(stepped or ()) | set(present))
        for ti in steps:  # in the batch without ids: a step, as SparseAdam's
            self.steps[ti] += 1
        res.plane.apply(view, rg, p, present)
        staged.defer(rg, steps, "gradients")
        self.counters.add_io(IO.UPDATES, 1)
        self.counters.add_io(IO.UPDATED_ROWS, b.k.numel())
