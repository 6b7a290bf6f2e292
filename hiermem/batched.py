"""Multi-table batched operations and prefetch pinning (a mixin of HierarchicalStore).

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
from dataclasses import dataclass

import numpy as np
import torch

from . import validate
from .batches import Batch, Placement, dedup, runs
from .dataplane.batch import bag_of, first_bad, offsets_bad, sorted_runs, tables_present
from .dataplane.staging import to_host
from .errors import CapacityError, InvalidArgumentError, InvalidIdError, InvalidTypeError
from .stats import IO, timed
from .tiers.slots import by_table

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

    def __len__(self) -> int:
        return self.k.numel()


@dataclass
class _BagMemo:
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

    def matches(self, ids, tables, offsets, mode, psw) -> bool:
        return (self.ids is ids and self.ids_version == ids._version and self.tables is tables
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


class BatchedOps:
    """Multi-table lookups, fused pooled updates and pinning; mixed into HierarchicalStore."""

    # -- validation and dedup --------------------------------------------------------
    def _setup_batched(self) -> None:
        d = self.device
        self.max_dim = max(s.dim for s in self.tables)
        self._max_ids = torch.tensor([s.max_id for s in self.tables], dtype=torch.int64, device=d)
        self._max_ids_np = np.array([s.max_id for s in self.tables], dtype=np.int64)
        sizes = [s.num_rows for s in self.tables]
        self._linear = None
        if all(n is not None for n in sizes) and sum(sizes) < 2**62:
            self._linear = torch.tensor(np.cumsum([0] + sizes[:-1]), dtype=torch.int64, device=d)
            self._linear_np = np.cumsum([0] + sizes[:-1]).astype(np.int64)
        self._multi_memo: _BagMemo | None = None
        self._live_tickets: list[Ticket] = []  # pinned, not yet released
        self._soon: tuple[torch.Tensor, torch.Tensor] | None = None  # rows of the next batches (lookahead)
        self._dedups: OrderedDict = OrderedDict()  # recent (tables, ids) -> Batch, see _dedup_multi
        self._dedups_lock = threading.Lock()

    def _dedup_multi(self, tables, ids):
        """Validated dedup of ``(tables, ids)`` (a Batch; None when empty), remembered for
        the same unchanged tensors: a pipeline's read-ahead and prefetch of one batch sort
        it once.  Pure (no lock needed): it reads only the tables' fixed layout."""
        key = (id(tables), id(ids))
        with self._dedups_lock:
            m = self._dedups.get(key)
        if m is not None and m[0] is tables and m[1] == tables._version and m[2] is ids and m[3] == ids._version:
            return m[4]
        t, k = self._multi_ids(tables, ids)
        b = self._batch_multi(t, k) if k.numel() else None
        with self._dedups_lock:
            self._dedups[key] = (tables, tables._version, ids, ids._version, b)
            while len(self._dedups) > 16:
                self._dedups.popitem(last=False)
        return b

    def _multi_ids(self, tables, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated ``(table index, id)`` per id, int64 on the store's device."""
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

    def _batch_multi(self, t: torch.Tensor, k: torch.Tensor):
        """Deduplicate ids of several tables at once (a :class:`~hiermem.batches.Batch`)."""
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

    def _src(self, tables, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefetch's inputs as the store's int64 tensors (no copy on the CPU)."""
        return to_host(tables, "ids").to(torch.int64), to_host(ids, "ids").to(torch.int64)

    def _ticket_batch(self, ticket: Ticket | None, tables, ids):
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

    # -- lookahead ----------------------------------------------------------------------
    @property
    def wants_lookahead(self) -> bool:
        """Whether the policy uses future ids (:meth:`set_lookahead`), e.g. ``lookahead``."""
        return bool(self._dev.policy.wants_lookahead)

    def set_lookahead(self, tables: torch.Tensor, ids: torch.Tensor) -> None:
        """The rows the next batches will use, for the next accounted placement only.

        A :class:`PrefetchPipeline` calls it before each prefetch (and each plain lookup
        of a batch whose prefetch was refused) with the ids of the ``window`` batches
        after it; a policy with ``wants_lookahead`` then evicts other rows first.  A
        no-op for other policies.
        """
        with self._lock:
            if not self.wants_lookahead:
                return
            t, k = self._multi_ids(tables, ids)
            if k.numel() == 0:
                self._soon = (t, k)
                return
            b = self._batch_multi(t, k)
            self._soon = (b.t, b.k)

    def _mark_soon(self) -> None:
        t, k = self._soon
        self._soon = None
        g = self._keys.find(t, k)
        D = self._dev.capacity
        self._dev.policy.on_lookahead(g[(g >= 0) & (g < D)])
        self._host.policy.on_lookahead(g[g >= D] - D)

    # -- prefetch and pins -------------------------------------------------------------
    def read_ahead(self, tables: torch.Tensor, ids: torch.Tensor, keep: int | None = None) -> int:
        """Read from LMDB the records of an upcoming batch's rows that are not resident,
        holding the store's lock only to find them (the read itself runs unlocked, so
        another thread's lookups and updates go on meanwhile).

        The records wait in the disk tier's cache, which serves the placement of that
        batch (its :meth:`prefetch`, or its lookup) instead of LMDB; a record written
        in the meantime is dropped, so the cache never serves a stale value.  Returns
        the records kept.  Changes nothing observable but speed.  ``keep``: how many
        read-ahead batches the cache holds (default 4; older ones are dropped unused).
        """
        b = self._dedup_multi(tables, ids)  # before the lock: it needs none
        if b is None:
            return 0
        with self._lock:
            self._check_open()
            miss = self._keys.find(b.t, b.k) < 0
            if not bool(miss.any()):
                return 0
            mt, mk = b.t[miss].cpu(), b.k[miss].cpu()
            mk_np = mk.numpy()
            groups = [(ti, mk_np[m], self.widths[ti]) for ti, m in by_table(mt.numpy())]
            token = self._disk.begin_read_ahead()
        return self._disk.read_ahead(groups, token, keep=keep)

    def _pin(self, p, delta: int) -> None:
        for tier, _, _, slots in self._res.parts(p):  # the CPU slots: pins are control-plane state
            tier.pin(slots, delta)

    def prefetch(self, tables: torch.Tensor, ids: torch.Tensor) -> Ticket:
        """Make the rows of an upcoming batch resident (device first) and pin them.

        Residency is accounted here, exactly as the batch's lookup would account it; the
        lookup given the returned ticket then counts prefetch hits instead.  When the
        rows cannot all be placed on the device beside the rows pinned there (or not
        twice beside all pinned rows in both tiers), nothing is pinned
        (``ticket.pinned`` is False, counted in ``PREFETCH_DEGRADED``, and the batch's
        lookup places it normally); it never raises for lack of room.

        Args:
            tables: table index of each id (int, 1-D).
            ids: the ids (int, 1-D), duplicates allowed.
        """
        with self._lock:
            self._check_open()
            b = self._dedup_multi(tables, ids)
            if b is None:
                e = torch.zeros(0, dtype=torch.int64, device=self.device)
                return Ticket(e, e, 0, True, True, True)
            if self._recorder is not None:  # traces keep batch order, refused prefetches too (hiermem.sim)
                self._recorder.record(b)
            self.counters.add_io(IO.PREFETCH_REQUESTS, 1)
            pinned_dev = self._dev.pinned
            pinned = pinned_dev + self._host.pinned
            # admission: the batch fits on the device beside the rows pinned there (one that
            # does not is looked up normally, its LMDB records already read ahead), and
            # leaves room for one more like it beside every pinned row
            U = b.k.numel()
            if pinned_dev + U > self._dev.capacity or pinned + 2 * U > self._dev.capacity + self._host.capacity:
                self.counters.add_io(IO.PREFETCH_DEGRADED, 1)
                return Ticket(b.t, b.k, b.n, False, False, False, batch=b, src=self._src(tables, ids))
            try:
                p = self._place(b, account=True, record=False)
            except CapacityError:  # nothing changed
                self.counters.add_io(IO.PREFETCH_DEGRADED, 1)
                return Ticket(b.t, b.k, b.n, False, False, False, batch=b, src=self._src(tables, ids))
            self._pin(p, 1)
            on_dev = p.on_device is None
            if p.was_on_device is not None:  # None: every row was on the device already
                now_dev = torch.ones_like(p.was_on_device) if on_dev else p.on_device
                self.counters.add_io(IO.PREFETCHED_ROWS, int((now_dev & ~p.was_on_device).sum()))
            self.counters.add_io(IO.PREFETCHED_BATCHES, 1)
            self.counters.add_io(IO.PREFETCH_PINNED_ROWS, b.k.numel())
            if not on_dev:
                self.counters.add_io(IO.PREFETCH_DEGRADED, 1)
            ticket = Ticket(b.t, b.k, b.n, True, on_dev, True, batch=b, src=self._src(tables, ids),
                            slots=p.slot if on_dev else None)
            self._live_tickets.append(ticket)
            return ticket

    def release(self, ticket: Ticket) -> None:
        """Unpin the rows of a prefetched batch (idempotent)."""
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            if not ticket.pinned or not len(ticket) or self._closed:
                return
            self._unpin(ticket)
            self._live_tickets = [x for x in self._live_tickets if x is not ticket]

    def _unpin(self, ticket: Ticket) -> None:
        if ticket.slots is not None:  # pinned on the device, where pinned rows stay
            self._dev.pin(ticket.slots, -1)
            return
        g = self._keys.find(ticket.t, ticket.k)
        assert bool((g >= 0).all()), "a pinned row is not resident"
        D = self._dev.capacity
        on_dev = g < D
        self._dev.pin(g[on_dev], -1)
        self._host.pin(g[~on_dev] - D, -1)

    def revoke_prefetches(self) -> int:
        """Unpin every outstanding prefetch (their batches are then looked up as if not
        prefetched, without being accounted twice); returns how many were revoked."""
        with self._lock:
            live = [x for x in self._live_tickets if x.pinned and not x.released]
            for x in live:
                self._unpin(x)
                x.pinned = False
            self._live_tickets = []
            self.counters.add_io(IO.PREFETCH_REVOKED, len(live))
            return len(live)

    def _place_batch(self, b, ticket: Ticket | None, extra: dict | None = None):
        """Placement for a lookup: accounted, or, for a pinned ticket, its resident rows
        (where they are pinned, device or host: nothing moves, nothing is accounted)."""
        if ticket is None or not ticket.pinned:
            account = ticket is None or not ticket.accounted
            try:  # a prefetched batch was recorded when it was prefetched
                return self._place(b, account=account, record=ticket is None, extra=extra)
            except CapacityError:  # later batches' pins hold the room this batch needs
                if not self.revoke_prefetches():
                    raise
                return self._place(b, account=account, record=ticket is None, extra=extra)
        # pinned rows are resident (admission places a pinned batch on the device whole,
        # and pinned rows are never victims): locate them, nothing moves
        p = self._res.locate(b)
        assert p is not None, "a pinned row is not resident"
        n_dev = b.counts if p.on_device is None else b.counts[p.on_device]
        self.counters.add_io(IO.PREFETCH_HITS, int(n_dev.sum()))
        return p

    # -- pooled single-table ops (nn.EmbeddingBag semantics) -------------------------------
    def _offsets(self, n: int, offsets) -> torch.Tensor:
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

    def _bags(self, n: int, offsets: torch.Tensor, mode: str, psw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bag of each id, and the per-id scale (per-sample weight, 1/len for mean)."""
        if mode not in ("sum", "mean"):
            raise InvalidArgumentError(f"mode must be 'sum' or 'mean', got {mode!r}")
        lengths = None
        bag = torch.from_numpy(bag_of(offsets.contiguous().numpy(), n))  # one compiled pass
        scale = None
        if psw is not None:
            if not isinstance(psw, torch.Tensor) or not psw.is_floating_point() or tuple(psw.shape) != (n,):
                raise InvalidArgumentError(f"per_sample_weights must be a float tensor of shape ({n},)")
            if mode != "sum":
                raise InvalidArgumentError("per_sample_weights need mode='sum' (as nn.EmbeddingBag)")
            # float data: on the device (pooling weights); no wait when it comes from the CPU
            scale = psw.detach().to(self.device, torch.float32, non_blocking=True)
        elif mode == "mean":  # on the CPU, staged to the device with the batch's control arrays
            lengths = torch.diff(offsets, append=torch.tensor([n]))
            scale = (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag)
        return bag, scale

    @timed("lookup_seconds")
    def lookup_pooled(self, table: str, ids, offsets: torch.Tensor, mode: str = "sum",
                      per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows ``[len(offsets), dim]``, as ``nn.EmbeddingBag(ids, offsets)``.

        Bag ``i`` holds ``ids[offsets[i]:offsets[i+1]]`` (the last runs to the end); an
        empty bag pools to zeros.  Gather and pooling are one fused op when every row
        is on the device tier.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids_in = ids
            ids = self._ids(ti, ids)
            offsets = self._offsets(ids.numel(), offsets)
            bag, scale = self._bags(ids.numel(), offsets, mode, per_sample_weights)
            dim = self.tables[ti].dim
            if ids.numel() == 0:
                return torch.zeros((offsets.numel(), dim), dtype=torch.float32, device=self.device)
            b = self._batch(ti, ids)
            extra = self._staged_path.extras(b, offsets, bag, scale)
            p = self._place(b, account=True, extra=extra)
            self._memo = self._memo_of(ids_in, ids, b, p, ti)
            return self.plane.pool(self, p, b.inverse, offsets, ids.numel(), dim, mode,
                                   None if per_sample_weights is None else scale)

    @timed("update_seconds")
    def update_pooled(self, table: str, ids, offsets: torch.Tensor, grad_output: torch.Tensor, mode: str = "sum",
                      per_sample_weights: torch.Tensor | None = None) -> None:
        """The backward of :meth:`lookup_pooled` fused with the optimizer step.

        ``grad_output [len(offsets), dim]`` is the gradient of the pooled rows; each id
        gets its bag's gradient (scaled by its weight, or ``1/len`` for mean), and then
        :meth:`update` semantics apply.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids_in = ids
            # the lookup's unchanged ids were validated by it
            ids = ids if self._memo_for(ti, ids) is not None else self._ids(ti, ids)
            offsets = self._offsets(ids.numel(), offsets)
            bag, scale = self._bags(ids.numel(), offsets, mode, per_sample_weights)
            grad_output = self._values(ti, offsets.numel(), grad_output, "grad_output", check_finite=False)
            self._update(ti, ids_in, ids, grad_output, bag, scale)  # id j: grad_output[bag[j]] * scale[j]

    # -- pooled multi-table ops ---------------------------------------------------------
    @timed("lookup_seconds")
    def lookup_bags(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mode: str = "sum",
                    per_sample_weights: torch.Tensor | None = None, ticket: Ticket | None = None) -> torch.Tensor:
        """Pooled rows of bags over several tables: ``[len(offsets), max_dim]``.

        Bag ``i`` holds ``ids[offsets[i]:offsets[i+1]]``, all of one table (``tables``
        gives each id's table index); columns past a table's ``dim`` are meaningless.
        One gather-and-pool op when every row is on the device tier.

        Args:
            ticket: the :meth:`prefetch` ticket of this batch, if it was prefetched.
        """
        with self._lock:
            self._check_open()
            b = self._ticket_batch(ticket, tables, ids)
            if b is None:
                t, k = self._multi_ids(tables, ids)
            n = k.numel() if b is None else b.n
            offsets_in = offsets
            offsets = self._offsets(n, offsets)
            bag, scale = self._bags(n, offsets, mode, per_sample_weights)
            D = self.max_dim
            if n == 0:
                return torch.zeros((offsets.numel(), D), dtype=torch.float32, device=self.device)
            prefetched = b is not None
            b = self._batch_multi(t, k) if b is None else b
            extra = self._staged_path.extras(b, offsets, bag, scale)
            if prefetched and ticket.pinned and not ticket.released and ticket.slots is not None:
                # pinned on the device by its prefetch: rows stay put
                self.counters.add_io(IO.PREFETCH_HITS, n)
                p = Placement(None, ticket.slots)
            else:
                p = self._place_batch(b, ticket, extra)
            self._staged_path.staged(b, p, extra)  # the plan's, the placement's and the step's arrays: one copy
            self._multi_memo = _BagMemo(ids, ids._version, tables, tables._version, offsets_in, mode,
                                        per_sample_weights, b, p, self._res.epoch, ticket, bag, scale, offsets.numel())
            return self.plane.pool(self, p, b.inverse, offsets, n, D, mode,
                                   None if per_sample_weights is None else scale)

    @timed("update_seconds")
    def update_bags(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                    mode: str = "sum", per_sample_weights: torch.Tensor | None = None,
                    ticket: Ticket | None = None, stepped: list[int] | None = None) -> None:
        """The backward of :meth:`lookup_bags` fused with the optimizer step.

        ``grad [len(offsets), max_dim]`` is the gradient of the pooled bags (columns past
        a table's dim are ignored).  Each distinct row takes one optimizer step with the
        sum of its ids' gradients, in place in its tier; NaN/inf is refused first.  Given
        the same (unchanged) tensors as the preceding :meth:`lookup_bags`, it reuses that
        lookup's validation, dedup and placement (the placement even after other batches
        moved rows, when the batch's prefetch ticket pins all its rows on the device).
        ``stepped``: table indices that take an optimizer step even without ids in this
        batch (the collection passes all its tables: Adam's step count then follows
        ``torch.optim.SparseAdam`` on an ``nn.EmbeddingBag`` that saw an empty batch).
        """
        with self._lock:
            self._check_open()
            m = self._multi_memo
            if m is not None and m.matches(ids, tables, offsets, mode, per_sample_weights):
                b, bag, scale, nbags = m.b, m.bag, m.scale, m.nbags
                p = m.p if m.placement_valid(self._res.epoch, ticket) else None
                if p is None and ticket is not None and ticket.pinned and not ticket.released:
                    p = self._res.locate(b)  # its rows are pinned where they are
                t = k = None
            else:
                t, k = self._multi_ids(tables, ids)
                offsets = self._offsets(k.numel(), offsets)
                bag, scale = self._bags(k.numel(), offsets, mode, per_sample_weights)
                b, p, nbags = None, None, offsets.numel()
            D = self.max_dim
            if not isinstance(grad, torch.Tensor) or not grad.is_floating_point() or tuple(grad.shape) != (nbags, D):
                raise InvalidArgumentError(f"grad must be a float tensor of shape {(nbags, D)}")
            if bag.numel() == 0:
                for ti in stepped or ():
                    self._steps[ti] += 1
                return
            if b is None:
                b = self._batch_multi(t, k)
                p = self._res.locate(b) if ticket is not None and ticket.pinned else None
            # each distinct row's gradient: the sum over its ids of their bag's gradient
            # (times the id's scale), formed by the data plane
            self._update_multi(b, p, grad.detach().to(self.device), bag, scale, stepped)

    def _update_multi(self, b, p, grad: torch.Tensor, bag: torch.Tensor, scale: torch.Tensor | None,
                      stepped=None) -> None:
        """Apply the gradients of bags ``grad`` to the rows of batch ``b`` (placement ``p``,
        None: place it now): one optimizer step per distinct row, in place in its tier."""
        self._staged_path.check_deferred()
        rg = self._staged_path.row_grads(b, p, grad, bag, scale)
        self.plane.check(rg, "gradients")
        if p is None:
            try:
                p = self._place(b, account=False)
            except CapacityError:
                if not self.revoke_prefetches():
                    raise
                p = self._place(b, account=False)
        if self._staging and p.dev is None:  # located, not placed: its slots to the device
            p.dev = self._staged_path.stage(b, p)
        present = tables_present(b.t.contiguous().numpy(), len(self.tables)).tolist()  # one compiled pass
        steps = sorted(set(stepped or ()) | set(present))
        for ti in steps:  # in the batch without ids: a step, as SparseAdam's
            self._steps[ti] += 1
        self.plane.apply(self, rg, p, present)
        self._staged_path.defer(rg, steps, "gradients")
        self.counters.add_io(IO.UPDATES, 1)
        self.counters.add_io(IO.UPDATED_ROWS, b.k.numel())
