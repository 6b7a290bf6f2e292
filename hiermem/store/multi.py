"""Multi-table batches and prefetch pins: parts a :class:`~hiermem.store.HierarchicalStore` owns.

A collection looks up all its tables in one op: every id comes with the index of its
table, and a batch is deduplicated over the *linearised* id space (table offset + id)
when every table is bounded, or over ``(table, id)`` pairs (two stable sorts) when one
is unbounded.  Pooled lookups gather straight from the device tier with one
``embedding_bag`` when every row is resident there.

Prefetch (see :class:`~hiermem.PrefetchPipeline`) is ``prefetch`` -> :class:`Ticket`:
the rows of an upcoming batch are made resident (device first) with full accounting, as
a lookup of that batch would, and *pinned* where they land.  Pinned slots are never
victims, and pins move with a row between tiers, so no later batch can evict a row an
in-flight batch needs.  The batch's own lookup then finds its rows resident (counting
prefetch hits, no second residency accounting); ``release`` unpins after its update.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from . import validate
from .placed import Batch, Placement, dedup, runs
from ..dataplane.batch import bag_of, first_bad, offsets_bad, sorted_runs
from ..dataplane.staging import to_host
from ..errors import CapacityError, InvalidArgumentError, InvalidIdError, InvalidTypeError
from ..observe.stats import IO, Counters
from ..types import TableSpec

if TYPE_CHECKING:
    from .residency import Residency

_INT_DTYPES = validate.INT_DTYPES


@dataclass
class Ticket:
    """The distinct rows of one prefetched batch, pinned until :meth:`release`.

    ``pinned`` is False when the prefetch was refused (no room beside the rows already
    pinned: the batch is then looked up normally) or revoked (a batch that was not
    prefetched needed the room); ``on_device`` tells whether every row landed on the
    device tier.
    """

    t: torch.Tensor
    k: torch.Tensor
    ids: int
    pinned: bool
    on_device: bool
    accounted: bool  # the prefetch placed and accounted the batch (its lookup must not again)
    released: bool = False
    batch: object = None  # the prefetch's dedup (a store Batch), for its lookup to reuse
    src: tuple | None = None  # the (tables, ids) tensors the prefetch was given
    slots: torch.Tensor | None = None  # device slots of its rows while pinned (they cannot move)
    bags: "ReadyBags | None" = None  # the lookup's bags, prepared with the prefetch

    def __len__(self) -> int:
        return self.k.numel()


def prefetch_now(ticket: "Ticket | None") -> bool:
    """Whether the prefetch of batch ``i + depth`` starts right after batch ``i``'s lookup
    (True: its rows were pinned at the lookup, so no prefetch can move them before its
    update) or only after batch ``i``'s release (False).  The one rule of the prefetch
    order, for the pipeline's threads (:mod:`hiermem.nn.pipeline`) and the simulator's
    single-threaded replay (:func:`prefetch_order`) alike."""
    return ticket is not None and ticket.pinned


def prefetch_order(n: int, depth: int, ticket_of: Callable[[int], "Ticket | None"]
                   ) -> Iterator[tuple[str, int]]:
    """The prefetch pipeline's order over ``n`` batches at ``depth``, one step at a time:
    ``("P", j)`` prefetch batch j, ``("L", i)`` its lookup, ``("U", i)`` its update,
    ``("R", i)`` its release.  P(0..depth-1) first; per batch i: L(i), then P(i+depth)
    where :func:`prefetch_now` says so, U(i), R(i), else P(i+depth) after R(i).
    ``ticket_of(i)`` is read after L(i) is yielded (the prefetch's ticket then)."""
    for j in range(min(depth, n)):
        yield "P", j
    for i in range(n):
        yield "L", i
        now = prefetch_now(ticket_of(i))
        if now and i + depth < n:
            yield "P", i + depth
        yield "U", i
        yield "R", i
        if not now and i + depth < n:
            yield "P", i + depth


@dataclass
class ReadyBags:
    """A lookup's validated bags, prepared ahead (by the prefetch of its batch): reused
    when the lookup passes the very ``offsets`` (and weights) they came from, unchanged."""

    offsets_in: torch.Tensor
    offsets_version: int
    mode: str
    psw: torch.Tensor | None
    offsets: torch.Tensor
    bag: torch.Tensor
    scale: torch.Tensor | None
    samples: int | None = None

    def matches(self, offsets, mode, psw, samples: int | None = None) -> bool:
        return (self.offsets_in is offsets and self.offsets_version == offsets._version and self.mode == mode
                and self.psw is psw and self.samples == samples)


@dataclass
class BagMemo:
    """What ``lookup_bags`` validated and placed, for the ``update_bags`` that follows."""

    ids: torch.Tensor
    ids_version: int
    tables: torch.Tensor
    tables_version: int
    offsets: torch.Tensor
    mode: str
    psw: torch.Tensor | None
    b: object
    p: object
    epoch: int
    ticket: Ticket | None
    bag: torch.Tensor
    scale: torch.Tensor | None
    nbags: int
    samples: int | None = None

    def matches(self, ids, tables, offsets, mode, psw, samples: int | None = None) -> bool:
        return (self.samples == samples and self.ids is ids and self.ids_version == ids._version and self.tables is tables
                and self.tables_version == tables._version and self.offsets is offsets
                and self.offsets_version == offsets._version and self.mode == mode and self.psw is psw
                and (psw is None or self.psw_version == psw._version))

    def __post_init__(self) -> None:
        self.offsets_version = self.offsets._version
        self.psw_version = None if self.psw is None else self.psw._version

    def placement_valid(self, epoch: int, ticket: Ticket | None) -> bool:
        """No row moved since, or none of this batch's can: all pinned on the device
        (device rows leave only as victims, and pinned rows are never victims)."""
        if epoch == self.epoch:
            return True
        t = self.ticket
        return (t is not None and t is ticket and t.pinned and not t.released and t.on_device
                and getattr(self.p, "on_device", 0) is None)


def offsets_of(n: int, offsets) -> torch.Tensor:
    """Validated bag offsets of ``n`` ids, int64 on the CPU (as the ids)."""
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int64, torch.int32) \
            or offsets.dim() != 1:
        raise InvalidTypeError("offsets must be a 1-D int64/int32 tensor")
    offsets = to_host(offsets, "ids").to(torch.int64).contiguous()  # control: on the CPU, as the ids
    if offsets.numel() == 0:
        raise InvalidArgumentError("offsets must have one entry per bag (at least one)")
    bad = offsets_bad(offsets.numpy(), n)  # one compiled pass
    if bad:
        raise InvalidArgumentError(f"offsets must start at 0, not decrease and not pass len(ids)={n}")
    return offsets


def check_samples(samples: int | None, nbags: int) -> None:
    """``samples`` (see :meth:`HierarchicalStore.lookup_bags`) must divide the bags."""
    if samples is None:
        return
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1 or nbags % samples:
        raise InvalidArgumentError(f"samples must be a positive int that divides the {nbags} bags, got {samples!r}")


def bags_of(n: int, offsets: torch.Tensor, mode: str, psw, device: torch.device, samples: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Bag of each of ``n`` ids (with ``samples``: its bag's sample-major row, see
    :func:`~hiermem.dataplane.batch.bag_of`), and the per-id scale (per-sample weight on
    ``device``, 1/len for mean on the CPU, else None)."""
    if mode not in ("sum", "mean"):
        raise InvalidArgumentError(f"mode must be 'sum' or 'mean', got {mode!r}")
    o = offsets.contiguous().numpy()
    check_samples(samples, o.size)
    bag = torch.from_numpy(bag_of(o, n, samples or 0))  # one compiled pass
    scale = None
    if psw is not None:
        if not isinstance(psw, torch.Tensor) or not psw.is_floating_point() or tuple(psw.shape) != (n,):
            raise InvalidArgumentError(f"per_sample_weights must be a float tensor of shape ({n},)")
        if mode != "sum":
            raise InvalidArgumentError("per_sample_weights need mode='sum' (as nn.EmbeddingBag)")
        # float data: on the device (pooling weights); no wait when it comes from the CPU
        scale = psw.detach().to(device, torch.float32, non_blocking=True)
    elif mode == "mean":  # on the CPU, staged to the device with the batch's control arrays
        lengths = torch.diff(offsets, append=torch.tensor([n]))
        own = bag if samples is None else torch.from_numpy(bag_of(o, n, 0))  # per position, whatever the rows
        scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, own)
    return bag, scale


def ticket_batch(ticket: Ticket | None, tables, ids):
    """The prefetch's Batch (validated, deduplicated) for a lookup given its ticket.

    Raises:
        InvalidArgumentError: ``(tables, ids)`` are not what the prefetch was given.
    """
    if ticket is None or ticket.src is None:
        return None

    def same(a, b):
        if a is b:
            return True
        if not isinstance(a, torch.Tensor) or a.dtype not in _INT_DTYPES or a.shape != b.shape:
            return False
        return bool(torch.equal(to_host(a, "ids").to(torch.int64), b))
    if not (same(tables, ticket.src[0]) and same(ids, ticket.src[1])):
        raise InvalidArgumentError("this ticket was issued by the prefetch of other ids: pass the ticket "
                                   "of this batch (or none)")
    return ticket.batch


def _src(tables, ids) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A prefetch's inputs as the store's int64 tensors (no copy on the CPU); None for a
    caller that passes none (the simulator's batches come from its trace)."""
    if tables is None:
        return None
    return to_host(tables, "ids").to(torch.int64), to_host(ids, "ids").to(torch.int64)


class MultiIds:
    """Validation and dedup of ids of several tables at once (each id with its table's
    index).  Pure: it reads only the tables' fixed layout, so it needs no lock.

    Args:
        tables: the store's tables.
        device: the store's device.
    """

    def __init__(self, tables: Sequence[TableSpec], device: torch.device):
        self.tables = tuple(tables)
        self._max_ids_np = np.array([s.max_id for s in tables], dtype=np.int64)
        sizes = [s.num_rows for s in tables]
        self._linear = None
        if all(n is not None for n in sizes) and sum(sizes) < 2**62:
            self._linear = torch.tensor(np.cumsum([0] + sizes[:-1]), dtype=torch.int64, device=device)
            self._linear_np = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        self._dedups: OrderedDict = OrderedDict()  # recent (tables, ids) -> Batch, see dedup
        self._dedups_lock = threading.Lock()

    def dedup(self, tables, ids):
        """Validated dedup of ``(tables, ids)`` (a Batch; None when empty), remembered for
        the same unchanged tensors: a pipeline's read-ahead and prefetch of one batch sort
        it once."""
        key = (id(tables), id(ids))
        with self._dedups_lock:
            m = self._dedups.get(key)
        if m is not None and m[0] is tables and m[1] == tables._version and m[2] is ids and m[3] == ids._version:
            return m[4]
        t, k = self.ids(tables, ids)
        b = self.batch(t, k) if k.numel() else None
        with self._dedups_lock:
            self._dedups[key] = (tables, tables._version, ids, ids._version, b)
            while len(self._dedups) > 16:
                self._dedups.popitem(last=False)
        return b

    def ids(self, tables, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated ``(table index, id)`` per id, int64 on the CPU."""
        validate.int_vector("tables", tables)
        validate.int_vector("ids", ids)
        if tables.numel() != ids.numel():
            raise InvalidArgumentError(f"tables ({tables.numel()}) and ids ({ids.numel()}) differ in length")
        # the control plane reads them on the CPU: they come there once (the one inherent
        # device-to-host copy of a step when the caller's ids are on the GPU)
        t = to_host(tables, "ids").to(torch.int64)
        k = to_host(ids, "ids").to(torch.int64)
        if k.numel():  # one compiled pass
            j, what = first_bad(t.contiguous().numpy(), k.contiguous().numpy(), len(self.tables), self._max_ids_np)
            if what == 0:
                raise InvalidArgumentError(f"table indices must be in [0, {len(self.tables)})")
            if what == 1:
                spec = self.tables[int(t[j])]
                rng = f"[0, {spec.num_rows})" if spec.num_rows is not None else "[0, 2**63)"
                raise InvalidIdError(f"table {spec.name}: id {int(k[j])} outside {rng}")
        return t, k

    def batch(self, t: torch.Tensor, k: torch.Tensor) -> Batch:
        """Deduplicate ids of several tables at once (a :class:`~hiermem.store.placed.Batch`)."""
        n = k.numel()
        if self._linear is not None and k.device.type == "cpu":  # one compiled radix sort
            perm, starts, inverse, counts, lastpos, uk, ut = sorted_runs(k, t, self._linear_np)
        elif self._linear is not None:
            u, inverse, counts, lastpos, perm, starts = dedup(self._linear.index_select(0, t) + k)
            ut = torch.searchsorted(self._linear, u, right=True) - 1
            uk = u - self._linear.index_select(0, ut)
        elif k.device.type == "cpu":  # lexicographic (table, id) order: one compiled radix sort
            perm, starts, inverse, counts, lastpos, uk, ut = sorted_runs(k, t)
        else:  # lexicographic (table, id) order from two stable sorts
            o1 = torch.argsort(k, stable=True)
            perm = o1.index_select(0, torch.argsort(t.index_select(0, o1), stable=True))
            ts, ks = t.index_select(0, perm), k.index_select(0, perm)
            starts, inverse, counts, lastpos = runs(perm, (ts[1:] != ts[:-1]) | (ks[1:] != ks[:-1]))
            ut, uk = ts.index_select(0, starts), ks.index_select(0, starts)
        return Batch(ut, uk, inverse, counts, lastpos, n, perm, starts)


Place = Callable[..., Placement]  # the store's accounted placement: place(b, account=, record=, extra=)


class Prefetches:
    """The pins of prefetched batches (tickets) and the lookahead of the next batches.

    Not thread-safe on its own: the store's lock guards every call.

    Args:
        res: the store's placement engine.
        counters: the store's counters (prefetch requests, hits, degraded, revoked).
        multi: the store's validation and dedup of multi-table batches.
    """

    def __init__(self, res: Residency, counters: Counters, multi: MultiIds):
        self.res, self.counters, self.multi = res, counters, multi
        self.live: list[Ticket] = []  # pinned, not yet released
        self.soon: tuple[torch.Tensor, torch.Tensor] | None = None  # rows of the next batches (lookahead)

    # -- lookahead ----------------------------------------------------------------------
    def set_soon(self, tables: torch.Tensor, ids: torch.Tensor, when: torch.Tensor | None = None) -> None:
        """The rows ``ids`` of ``tables`` (validated) as the next batches': ``when[j]``
        (int64 >= 1) how many batches ahead id ``j`` is used (None: its position + 1)."""
        t, k = self.multi.ids(tables, ids)
        if when is None:
            when = torch.arange(1, k.numel() + 1, dtype=torch.int64)
        else:
            when = torch.as_tensor(when, dtype=torch.int64).reshape(-1)
            if when.numel() != k.numel():
                raise InvalidArgumentError(f"when has {when.numel()} entries for {k.numel()} ids")
        self.soon = (t, k, when.clamp(min=1))

    def mark_soon(self) -> None:
        """Tell the policies which resident rows the next batches use, and how many batches
        ahead each is next used (the soonest of its uses); then forget them."""
        t, k, when = self.soon
        self.soon = None
        dev, host = self.res.tiers
        D = dev.capacity
        if k.numel() == 0:
            dev.policy.on_lookahead(k, k)
            host.policy.on_lookahead(k, k)
            return
        g = self.res.keys.find(t, k)
        keep = g >= 0
        g, when = g[keep], when[keep]
        u, inv = torch.unique(g, return_inverse=True)
        nxt = torch.full((u.numel(),), 1 << 40, dtype=torch.int64).scatter_reduce_(0, inv, when, "amin")
        on_dev = u < D
        dev.policy.on_lookahead(u[on_dev], nxt[on_dev])
        host.policy.on_lookahead(u[~on_dev] - D, nxt[~on_dev])

    # -- pins -----------------------------------------------------------------------------
    def pin(self, p: Placement, delta: int) -> None:
        for tier, _, _, slots in self.res.parts(p):  # the CPU slots: pins are control-plane state
            tier.pin(slots, delta)

    def pinned_on_device(self, b: Batch) -> int:
        """How many of batch ``b``'s rows are pinned on the device now."""
        g = self.res.keys.find(b.t, b.k)
        dev = self.res.tiers[0]
        on = g[(g >= 0) & (g < dev.capacity)]
        return int((dev.pins[on] > 0).sum()) if on.numel() else 0

    def prefetch(self, b: Batch | None, tables, ids, place: Place) -> Ticket:
        """The ticket of batch ``b`` (validated and deduplicated ``(tables, ids)``; None when
        empty): placed by ``place`` with accounting and pinned, if admitted."""
        if b is None:
            e = torch.zeros(0, dtype=torch.int64, device=self.res.device)
            return Ticket(e, e, 0, True, True, True)
        self.counters.add_io(IO.PREFETCH_REQUESTS, 1)
        dev, host = self.res.tiers
        pinned_dev = dev.pinned
        pinned = pinned_dev + host.pinned
        # admission: the batch fits on the device beside the rows pinned there (its rows
        # already pinned there, by the batches before it, take no more room; one that
        # does not fit is looked up normally, its LMDB records already read ahead), and
        # leaves room for one more like it beside every pinned row
        U = b.k.numel()
        if pinned_dev and pinned_dev + U > dev.capacity:
            U_dev = U - self.pinned_on_device(b)
        else:
            U_dev = U
        if pinned_dev + U_dev > dev.capacity or pinned + 2 * U > dev.capacity + host.capacity:
            self.counters.add_io(IO.PREFETCH_DEGRADED, 1)
            return Ticket(b.t, b.k, b.n, False, False, False, batch=b, src=_src(tables, ids))
        try:
            p = place(b, account=True, record=False)
        except CapacityError:  # nothing changed
            self.counters.add_io(IO.PREFETCH_DEGRADED, 1)
            return Ticket(b.t, b.k, b.n, False, False, False, batch=b, src=_src(tables, ids))
        self.pin(p, 1)
        on_dev = p.on_device is None
        if p.was_on_device is not None:  # None: every row was on the device already
            now_dev = torch.ones_like(p.was_on_device) if on_dev else p.on_device
            self.counters.add_io(IO.PREFETCHED_ROWS, int((now_dev & ~p.was_on_device).sum()))
        self.counters.add_io(IO.PREFETCHED_BATCHES, 1)
        self.counters.add_io(IO.PREFETCH_PINNED_ROWS, b.k.numel())
        if not on_dev:
            self.counters.add_io(IO.PREFETCH_DEGRADED, 1)
        ticket = Ticket(b.t, b.k, b.n, True, on_dev, True, batch=b, src=_src(tables, ids),
                        slots=p.slot if on_dev else None)
        self.live.append(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        """Unpin the rows of a ticket not yet released (the caller marked it released)."""
        if not ticket.pinned or not len(ticket):
            return
        self.unpin(ticket)
        self.live = [x for x in self.live if x is not ticket]

    def unpin(self, ticket: Ticket) -> None:
        dev, host = self.res.tiers
        if ticket.slots is not None:  # pinned on the device, where pinned rows stay
            dev.pin(ticket.slots, -1)
            return
        g = self.res.keys.find(ticket.t, ticket.k)
        assert bool((g >= 0).all()), "a pinned row is not resident"
        D = dev.capacity
        on_dev = g < D
        dev.pin(g[on_dev], -1)
        host.pin(g[~on_dev] - D, -1)

    def revoke(self) -> int:
        """Unpin every outstanding ticket; returns how many were revoked."""
        live = [x for x in self.live if x.pinned and not x.released]
        for x in live:
            self.unpin(x)
            x.pinned = False
        self.live = []
        self.counters.add_io(IO.PREFETCH_REVOKED, len(live))
        return len(live)

    def retry(self, fn: Callable[[], Placement]) -> Placement:
        """``fn()`` (a placement); when it finds no room, every outstanding ticket is
        revoked and it is tried once more (later batches' pins may hold the room it needs)."""
        try:
            return fn()
        except CapacityError:
            if not self.revoke():
                raise
            return fn()

    def place_batch(self, b: Batch, ticket: Ticket | None, extra: dict | None, place: Place) -> Placement:
        """Placement for a lookup: accounted, or, for a pinned ticket, its resident rows
        (where they are pinned, device or host: nothing moves, nothing is accounted)."""
        if ticket is None or not ticket.pinned:
            account = ticket is None or not ticket.accounted
            # a prefetched batch was recorded when it was prefetched
            return self.retry(lambda: place(b, account=account, record=ticket is None, extra=extra))
        # pinned rows are resident (admission places a pinned batch on the device whole,
        # and pinned rows are never victims): locate them, nothing moves
        p = self.res.locate(b)
        assert p is not None, "a pinned row is not resident"
        n_dev = b.counts if p.on_device is None else b.counts[p.on_device]
        self.counters.add_io(IO.PREFETCH_HITS, int(n_dev.sum()))
        return p
