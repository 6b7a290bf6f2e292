"""HierarchicalStore: embedding rows over a device tier, a host tier and an LMDB disk tier.

The hierarchy is *exclusive* above disk and write-back: a row is resident in at most one
of the device and host tiers; LMDB holds every row that was ever written down, and its
copy is the latest value exactly when the row is not resident or is resident and clean.
``where`` names the one place that holds each row's latest value: DEVICE, HOST, DISK, or
INIT (never written: the deterministic initialiser's value).

Every public method works on whole batches: a batch of ids is deduplicated once, its
placement is decided and committed by the compiled control plane (:mod:`hiermem.core`:
index, tiers' slot metadata, policies, victims, counters), misses are read from LMDB in
one batched read, dirty victims are written down in one transaction, and the data plane
copies records between the tier tensors.  Rows used by the current batch, or pinned, are
never evicted by it.

Thread-safety: every public method takes the store's re-entrant lock, so a prefetch
thread, a metrics scrape and the training loop may share one store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import HierMemError, InvalidArgumentError, LayoutMismatchError, NonFiniteGradientError, StoreClosedError
from ..core.policies import resolve_policy
from .rows import initial_records
from .overlap import can_overlap, resolve_write_behind
from ..dataplane.optim import Optimizer
from ..dataplane import DataPlane, PlaneView, default_plane, plane_named
from ..dataplane.deferred import DeferredApply, StoreLock, available as deferred_available, close_on_collect
from .placed import Batch, Placement, dedup
from .multi import MultiIds, Prefetches, Ticket, bags_of, offsets_of
from .bags import BagOps
from .residency import Residency
from . import locks, validate, warm
from .checkpoint import Checkpoints, restore as restore_checkpoint
from .meta import OVERRIDABLE, saved_config, saved_counters
from ..observe.stats import IO, Counters, store_stats, timed
from ..tiers import DiskTier, SlotTier
from ..tiers.combine import default_limit
from ..types import StoreConfig, TableSpec

from .locks import OPEN as _OPEN, OPEN_LOCK as _OPEN_LOCK  # noqa: E402


class HierarchicalStore:
    """Embedding tables over device, host and disk tiers.

    Args:
        tables: the tables (unique names).
        config: tier capacities, device, policy, optimizer, seed and path.
        row_init: ``row_init(ti, ids) -> records [n, widths[ti]]`` of rows of table ``ti``
            never written; None (the default): each table's deterministic initialiser
            (:func:`~hiermem.store.rows.initial_records`).  A shard store derives them
            from its logical table (:mod:`hiermem.sharding`).

    Creating a store on a path that already holds one reopens it when the table layout,
    optimizer and seed match, and raises :class:`LayoutMismatchError` otherwise.
    """

    def __init__(self, tables: Sequence[TableSpec], config: StoreConfig,
                 row_init: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        tables = validate.check_store_args(tables, config)
        config = config.resolved()  # a policy file's sizes and depth (the one read of it)
        self._row_init = row_init if row_init is not None else self._initial_records
        warm.ensure_compiled(store_class=HierarchicalStore)  # the first store compiles the kernels, once
        self.config = config
        self.tables: tuple[TableSpec, ...] = tables
        self._index = {s.name: i for i, s in enumerate(tables)}
        self.optimizer: Optimizer = config.optimizer
        self.device = validate.store_device(config.device)
        self.policy = resolve_policy(config.policy)
        self.widths = [s.dim + self.optimizer.state_width(s.dim) for s in tables]
        self.width = max(self.widths)
        # every call holds it; on entry it waits for the deferred fused update in flight
        self._lock = StoreLock()
        self._closed = True
        self.path = Path(config.path).absolute()
        self._lockfd, self._made_lock = locks.claim_store(self.path)
        try:
            self.write_behind, self.write_behind_reason = resolve_write_behind(config.write_behind, self.device)
            self._disk = DiskTier(self.path, create=True, map_size=config.map_size, sync=config.sync_writebacks,
                                  write_behind=self.write_behind, io_process=config.io_process,
                                  writemap=config.writemap, tables=len(tables), migrate=True,
                                  combine=self._combine_limit(config),
                                  combine_behind=config.write_behind == "combined")
            try:
                meta = self._disk.read_meta()
                meta_counters = (meta or {}).get("counters")
                self._steps = self._check_layout(meta)
                self._flush_seq = int((meta or {}).get("flush_seq", 0))
                self._checkpoints = Checkpoints(self.path, meta)  # (stale temporaries removed)
            except BaseException:
                self._disk.close()
                raise
        except BaseException:
            locks.release_store(self.path, self._lockfd, unlink=self._made_lock)
            raise
        self._counters = Counters(len(tables))
        # where every row is, and moving rows there (the control plane's kernels, the
        # disk tier's I/O and the data plane's copies)
        self._res = Residency(self.tables, self.widths, config, self.device, self.policy, self._disk, self._counters,
                              self._steps, self._row_init, self._meta)
        self._keys, self._dev, self._host = self._res.keys, self._res.dev, self._res.host
        self._staged_path = self._res.staged
        self._dims_np = np.array([s.dim for s in tables], dtype=np.int64)
        self.plane = default_plane(self.device)  # executes pooling and the fused optimizer
        self._base_table, self._base_io = saved_counters(meta_counters, self._counters)
        self._clock = 0
        self._memo: tuple | None = None  # last lookup's batch + placement, reused by update
        self._recorder = None  # a hiermem.observe.trace.TraceRecorder while recording
        self.max_dim = max(s.dim for s in tables)
        self._multi = MultiIds(self.tables, self.device)  # validation and dedup of multi-table batches
        self._prefetches = Prefetches(self._res, self._counters, self._multi)  # prefetch tickets, pins, lookahead
        # what the data plane and the bag ops read of this store (never the store itself)
        # fused updates off the calling thread where a core is free beside torch's intra-op
        # threads (the rule of every "auto" background default: hiermem.store.overlap)
        self._deferred = DeferredApply(enabled=self.device.type == "cpu" and can_overlap(self.device)[0])
        close_on_collect(self, self._deferred)
        self._lock.deferred = self._deferred
        self._view = PlaneView(self._res, self.optimizer, self._dims_np, self.widths, self._steps, self.device,
                               self._deferred)
        self._bags = BagOps(self._view, self._counters, self._multi, self._prefetches, self._place)
        self._closed = False
        if config.trace_path is not None:
            self.record(config.trace_path)
        from ..observe.metrics import STORES
        STORES.add(self)  # a weak reference; metrics are read only when scraped

    # -- opening and layout -------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, readonly: bool = False, **overrides) -> "HierarchicalStore":
        """Reopen a store from its directory alone.

        ``overrides`` replace fields of the saved :class:`StoreConfig` that are not part
        of the layout (``device``, ``device_rows``, ``host_rows``, ``policy``,
        ``prefetch_depth``, ``map_size``, ``sync_writebacks``, ``write_behind``,
        ``write_combine``, ``io_process``, ``writemap``, ``trace_path``).  A policy file given here applies
        its tier sizes and depth over the saved ones (an explicit override still wins).

        ``readonly=True`` opens a :class:`~hiermem.store.readonly.ReadOnlyStore` instead: any
        number of them, in other processes, while one process trains; see
        :mod:`hiermem.store.readonly` (``overrides``: ``device`` only).

        Raises:
            StoreFormatError: ``path`` is not a hiermem store, or is corrupt.
        """
        if readonly:
            from .readonly import ReadOnlyStore

            return ReadOnlyStore(path, **overrides)
        bad = set(overrides) - OVERRIDABLE
        if bad:
            raise InvalidArgumentError(f"cannot override {sorted(bad)} when reopening a store")
        with _OPEN_LOCK:  # before touching LMDB, which refuses a second handle itself
            if os.path.realpath(path) in _OPEN:
                raise HierMemError(f"{path}: store is already open in this process")
        cfg = saved_config(path, overrides)
        return cls(cfg[0], cfg[1])

    def _combine_limit(self, config: StoreConfig) -> int:
        """Rows of write-backs held for one combined commit: 0 with ``sync_writebacks``,
        else ``write_combine``, or where it is None the default for these tables
        (:func:`hiermem.tiers.combine.default_limit`)."""
        if config.sync_writebacks:
            return 0
        if config.write_combine is not None:
            return config.write_combine
        return default_limit([s.num_rows for s in self.tables], self.widths)

    def _layout(self) -> dict:
        return {"tables": [s.to_dict() for s in self.tables], "optimizer": self.optimizer.to_dict(),
                "seed": self.config.seed}

    def _meta(self) -> dict:
        c = self.config
        policy = self.policy.source or self.policy.name
        meta = {**self._layout(), "device": str(self.device), "device_rows": c.device_rows,
                "host_rows": c.host_rows, "policy": policy, "prefetch_depth": c.prefetch_depth,
                "steps": {s.name: self._steps[i] for i, s in enumerate(self.tables)},
                "flush_seq": getattr(self, "_flush_seq", 0), "checkpoint_dirs": self._checkpoints.dirs if hasattr(self, "_checkpoints") else []}
        if hasattr(self, "counters"):  # cumulative counters ride along with every metadata write
            table, io = self.cumulative_counters()
            meta["counters"] = {"table": table.tolist(), "io": {k.name.lower(): int(io[k]) for k in IO}}
        return meta

    def count_from_creation(self) -> None:
        """Make this session's counters (``stats()``, Prometheus) start from the lifetime
        totals saved by earlier sessions, not from zero: for serving a store at rest."""
        with self._lock:
            self.counters.table += self._base_table
            self.counters.io += self._base_io
            self._base_table.zero_()
            self._base_io.zero_()

    def cumulative_counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table x tier x Stat, IO)`` counters over the store's whole life: those saved by
        earlier sessions (with every flush, checkpoint and write-back) plus this session's."""
        return self._base_table + self.counters.table, self._base_io + self.counters.io

    def _check_layout(self, meta: dict | None) -> list[int]:
        if meta is None:
            self._steps = [0] * len(self.tables)
            self._disk.write([], meta=self._meta(), sync=True)
            return self._steps
        want, have = self._layout(), {k: meta.get(k) for k in ("tables", "optimizer", "seed")}
        if want != have:
            diff = [k for k in want if want[k] != have[k]]
            raise LayoutMismatchError(self.path, f"store was created with a different {', '.join(diff)}: "
                                      f"on disk {[have[k] for k in diff]}, asked {[want[k] for k in diff]}")
        return [int(meta.get("steps", {}).get(s.name, 0)) for s in self.tables]

    # -- validation ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.path}: store is closed")

    def table_index(self, table: str) -> int:
        return validate.table_index(self._index, table)

    def _ids(self, ti: int, ids) -> torch.Tensor:
        return validate.check_ids(self.tables[ti], ids)

    def _values(self, ti: int, n: int, values, what: str, check_finite: bool = True) -> torch.Tensor:
        return validate.check_values(self.tables[ti], n, values, what, self.device, check_finite)

    def _batch(self, ti: int, ids: torch.Tensor) -> Batch:
        k, inverse, counts, lastpos, perm, starts = dedup(ids)
        return Batch(torch.full_like(k, ti), k, inverse, counts, lastpos, ids.numel(), perm, starts)

    def _initial_records(self, ti: int, ids: torch.Tensor) -> torch.Tensor:
        """Records ``[n, widths[ti]]`` of rows of table ``ti`` never written: the default
        ``row_init``."""
        return initial_records(self.tables[ti], ti, self.config.seed, self.optimizer, ids)

    def _place(self, b: Batch, account: bool, record: bool = True, extra: dict | None = None) -> Placement:
        if self._deferred.pending is not None:  # (the lock's entry waited for it; a second
            self._deferred.wait()  # update in the same hold would not have: rows move next)
        if not account:
            return self._res.resolve(b, torch.full_like(b.k, self._clock), False, extra)
        if self._prefetches.soon is not None:  # a lookahead policy learns which resident rows come back soon
            self._prefetches.mark_soon()
        p = self._res.resolve(b, b.lastpos + self._clock, True, extra)
        self._clock += b.n  # only once the batch is placed: a refused batch leaves no trace
        if record and self._recorder is not None:  # trace capture (hiermem.observe.trace)
            self._recorder.record(b)
        return p

    # -- public API -----------------------------------------------------------------
    @timed("lookup_seconds")
    def lookup(self, table: str, ids) -> torch.Tensor:
        """Rows ``[len(ids), dim]`` (float32, on ``config.device``) of ``ids`` of ``table``.

        Duplicate ids are allowed.  Rows are promoted to the device tier (or the host
        tier when the device tier cannot hold the batch).

        Raises:
            InvalidIdError, InvalidTypeError, InvalidArgumentError, UnknownTableError,
            CapacityError, StoreClosedError, DiskFullError.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids_in = ids
            ids = self._ids(ti, ids)
            dim = self.tables[ti].dim
            if ids.numel() == 0:
                return torch.empty((0, dim), dtype=torch.float32, device=self.device)
            b = self._batch(ti, ids)
            p = self._place(b, account=True, extra=self._staged_path.extras(b))
            # keyed by the caller's tensor (ids of a CUDA caller were copied to the CPU)
            self._memo = self._memo_of(ids_in, ids, b, p, ti)
            return self._rows(p, b, dim)

    def _rows(self, p: Placement, b: Batch, dim: int) -> torch.Tensor:
        """Rows ``[n, dim]`` of every id of the batch (one gather when all are on device)."""
        d = p.dev
        if p.on_device is None:
            src = self._dev.data if dim == self._dev.width else self._dev.data[:, :dim]
            return src.index_select(0, p.slot.index_select(0, b.inverse) if d is None else d.ids_slot)
        return self._res.gather(p, dim).index_select(0, b.inverse if d is None else d.inverse)

    def _memo_of(self, ids_in, ids: torch.Tensor, b: Batch, p: Placement, ti: int) -> tuple:
        """A lookup's memo for the update that follows it: keyed by the caller's tensor
        (ids of a CUDA caller were copied to the CPU; a numpy array, converted, keys nothing
        an update could pass again)."""
        key = ids_in if isinstance(ids_in, torch.Tensor) else ids
        return key, key._version, b, p, self._res.epoch, ti

    def _memo_for(self, ti: int, ids) -> tuple[Batch, Placement] | None:
        """The last lookup's batch and placement, if ``ids`` is that lookup's unchanged
        tensor of the same table and no row has changed tier since."""
        m = self._memo
        if (m is not None and m[0] is ids and isinstance(ids, torch.Tensor) and m[1] == ids._version
                and m[4] == self._res.epoch and m[5] == ti):
            return m[2], m[3]
        return None

    @timed("update_seconds")
    def update(self, table: str, ids, grads: torch.Tensor) -> None:
        """Apply the optimizer to the rows of ``ids`` with gradients ``grads [n, dim]``.

        Gradients of duplicate ids are summed, then each distinct row takes one optimizer
        step in place in its tier (no dense gradient).  NaN/inf gradients are refused
        before anything changes.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids_in = ids
            ids = self._ids(ti, ids)
            grads = self._values(ti, ids.numel(), grads, "grads", check_finite=False)
            self._update(ti, ids_in, ids, grads)

    def _update(self, ti: int, ids_in, ids: torch.Tensor, grads: torch.Tensor, src: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> None:
        """update() after validation (caller holds the lock): each id ``j`` contributes
        ``grads[src[j]] * scale[j]`` (``grads[j]`` when ``src`` is None) to its row."""
        if ids.numel() == 0:
            return
        self._staged_path.check_deferred()
        memo = self._memo_for(ti, ids_in)
        b, p = memo if memo is not None else (self._batch(ti, ids), None)
        # the bags of this call's offsets (the memo matched the ids only): staged afresh
        rg = self._staged_path.row_grads(b, p, grads, src, scale, reuse_bags=False)
        what = f"grads of table {self.tables[ti].name}"
        # every row's gradient is checked before anything changes
        self.plane.check(rg, what)
        if p is None:
            p = self._place(b, account=False)
        self._steps[ti] += 1
        self.plane.apply(self._view, rg, p, [ti])
        self._staged_path.defer(rg, [ti], what)
        self.counters.add_io(IO.UPDATES, 1)
        self.counters.add_io(IO.UPDATED_ROWS, b.k.numel())

    # -- lookahead and prefetch (hiermem.store.multi.Prefetches) ----------------------------
    @property
    def wants_lookahead(self) -> bool:
        """Whether the policy uses future ids (:meth:`set_lookahead`), e.g. ``lookahead``."""
        return bool(self._dev.policy.wants_lookahead)

    def set_lookahead(self, tables: torch.Tensor, ids: torch.Tensor, when: torch.Tensor | None = None) -> None:
        """The rows the next batches will use, for the next accounted placement only.

        A :class:`PrefetchPipeline` calls it before each prefetch (and each plain lookup
        of a batch whose prefetch was refused) with the ids of the ``window`` batches
        after it, and ``when``: how many batches ahead each id is used (int64, >= 1;
        None: ids in order of use, one a batch).  A policy with ``wants_lookahead`` then
        evicts the rows the window does not use first, then the one used furthest
        ahead.  A no-op for other policies.
        """
        with self._lock:
            if self.wants_lookahead:
                self._prefetches.set_soon(tables, ids, when)

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
        b = self._multi.dedup(tables, ids)  # before the lock: it needs none
        if b is None:
            return 0
        with self._lock:
            self._check_open()
            groups = self._res.not_resident(b)
            if not groups:
                return 0
            token = self._disk.begin_read_ahead()
        return self._disk.read_ahead(groups, token, keep=keep)

    def prefetch(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                 mode: str = "sum", per_sample_weights: torch.Tensor | None = None,
                 samples: int | None = None) -> Ticket:
        """Make the rows of an upcoming batch resident (device first) and pin them.

        Residency is accounted here, exactly as the batch's lookup would account it; the
        lookup given the returned ticket then counts prefetch hits instead.  When the
        rows (those not pinned on the device already) cannot be placed on the device
        beside the rows pinned there (or not
        twice beside all pinned rows in both tiers), nothing is pinned
        (``ticket.pinned`` is False, counted in ``PREFETCH_DEGRADED``, and the batch's
        lookup places it normally); it never raises for lack of room.

        Args:
            tables: table index of each id (int, 1-D).
            ids: the ids (int, 1-D), duplicates allowed.
            offsets, mode, per_sample_weights, samples: the bags of the ``lookup_bags``
                this ticket is for, when known: their validation and each id's bag are done
                here (on the prefetch thread), and that lookup, given these very tensors,
                reuses them.
        """
        with self._lock:
            self._check_open()
            b = self._multi.dedup(tables, ids)
            if b is not None and self._recorder is not None:  # traces keep batch order, refused prefetches too
                self._recorder.record(b)
            ticket = self._prefetches.prefetch(b, tables, ids, self._place)
            if offsets is not None and b is not None:
                ticket.bags = self._bags.prepare(b.n, offsets, mode, per_sample_weights, samples)
            return ticket

    def release(self, ticket: Ticket) -> None:
        """Unpin the rows of a prefetched batch (idempotent)."""
        # the unfenced lock: an unpin touches neither rows nor what a deferred update reads,
        # so the backward's release does not wait for its own update
        with self._lock.unfenced:
            if ticket.released:
                return
            ticket.released = True
            if not self._closed:
                self._prefetches.release(ticket)

    def revoke_prefetches(self) -> int:
        """Unpin every outstanding prefetch (their batches are then looked up as if not
        prefetched, without being accounted twice); returns how many were revoked."""
        with self._lock:
            return self._prefetches.revoke()

    # -- pooled and multi-table ops (nn.EmbeddingBag semantics) ----------------------------
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
            offsets = offsets_of(ids.numel(), offsets)
            bag, scale = bags_of(ids.numel(), offsets, mode, per_sample_weights, self.device)
            dim = self.tables[ti].dim
            if ids.numel() == 0:
                return torch.zeros((offsets.numel(), dim), dtype=torch.float32, device=self.device)
            b = self._batch(ti, ids)
            extra = self._staged_path.extras(b, offsets, bag, scale)
            p = self._place(b, account=True, extra=extra)
            self._memo = self._memo_of(ids_in, ids, b, p, ti)
            return self.plane.pool(self._view, p, b.inverse, offsets, ids.numel(), dim, mode,
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
            offsets = offsets_of(ids.numel(), offsets)
            bag, scale = bags_of(ids.numel(), offsets, mode, per_sample_weights, self.device)
            grad_output = self._values(ti, offsets.numel(), grad_output, "grad_output", check_finite=False)
            self._update(ti, ids_in, ids, grad_output, bag, scale)  # id j: grad_output[bag[j]] * scale[j]

    @timed("lookup_seconds")
    def lookup_bags(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mode: str = "sum",
                    per_sample_weights: torch.Tensor | None = None, ticket: Ticket | None = None,
                    samples: int | None = None) -> torch.Tensor:
        """Pooled rows of bags over several tables: ``[len(offsets), max_dim]``.

        Bag ``i`` holds ``ids[offsets[i]:offsets[i+1]]``, all of one table (``tables``
        gives each id's table index); columns past a table's ``dim`` are meaningless.
        One gather-and-pool op when every row is on the device tier.

        Args:
            ticket: the :meth:`prefetch` ticket of this batch, if it was prefetched.
            samples: when the bags are ``T`` tables of ``samples`` bags each (table-major,
                as a collection's features), the result is sample-major instead:
                ``[samples, T * max_dim]``, sample ``s``'s bag of the ``t``-th table at
                columns ``t * max_dim ..``, written there by the pooling itself (no
                transposing copy, and none for the gradient in :meth:`update_bags`).
        """
        with self._lock:
            self._check_open()
            return self._bags.lookup(tables, ids, offsets, mode, per_sample_weights, ticket, samples)

    @timed("update_seconds")
    def update_bags(self, tables: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                    mode: str = "sum", per_sample_weights: torch.Tensor | None = None,
                    ticket: Ticket | None = None, stepped: list[int] | None = None,
                    samples: int | None = None, grad_owned: bool = False) -> None:
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
        ``samples``: as the lookup's; ``grad`` is then ``[samples, T * max_dim]``.
        ``grad_owned``: the caller will not write ``grad`` after the call (autograd's
        gradient), so a deferred update (:attr:`deferred_updates`) reads it in place; by
        default it copies it first.
        """
        with self._lock:
            self._check_open()
            self._bags.update(tables, ids, offsets, grad, mode, per_sample_weights, ticket, stepped, samples,
                              grad_owned)

    # -- read-only views for the store's collaborators (metrics, pipeline, modules) ------
    @property
    def lock(self) -> StoreLock:
        """The store's (re-entrant) lock: every call holds it; hold it to read several
        figures of one moment, or to keep the store's state still (entering it waits for
        a deferred update in flight, so what it shows includes every update made)."""
        return self._lock

    @property
    def slot_tiers(self) -> tuple[SlotTier, SlotTier]:
        """The slot tiers, fastest first: ``(device, host)``.  Their metadata is the
        control plane's; read it under :attr:`lock`, change it never."""
        return self._res.tiers

    @property
    def device_tier(self) -> SlotTier:
        return self._dev

    @property
    def host_tier(self) -> SlotTier:
        return self._host

    @property
    def counters(self) -> Counters:
        """This session's counters (hits, misses, evictions, bytes moved, durations), shared
        with the placement engine and the prefetches: read it or take differences of it
        (``stats()``, Prometheus); it cannot be replaced."""
        return self._counters

    @property
    def disk(self) -> DiskTier:
        """The LMDB tier (its counters and timers are read by metrics)."""
        return self._disk

    def table_step(self, table: str) -> int:
        """Optimizer steps table ``table`` has taken (Adam's bias correction counts them)."""
        return self._steps[self.table_index(table)]

    def set_table_step(self, table: str, step: int) -> None:
        """Set table ``table``'s optimizer step count (a module's ``load_state_dict``)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"step must be an int >= 0, got {step!r}")
        with self._lock:
            self._steps[self.table_index(table)] = step

    @property
    def residency(self) -> Residency:
        """The placement engine: index, slot tiers, plans (:class:`~hiermem.store.residency.Residency`).
        The data plane reads placed rows through it; use it under :attr:`lock`."""
        return self._res

    @property
    def steps(self) -> tuple[int, ...]:
        """The optimizer step count of each table (in table order)."""
        return tuple(self._steps)

    @property
    def dims(self) -> np.ndarray:
        """Each table's embedding dim (int64; the kernels take it as is: do not write to it)."""
        return self._dims_np

    @property
    def plane(self) -> DataPlane:
        """The data plane object executing pooling and the fused optimizer."""
        return self._res.plane

    @plane.setter
    def plane(self, plane: DataPlane) -> None:
        with self._lock:  # (after the update in flight)
            self._res.plane = plane
            # the data plane reads staged control arrays on CUDA, and on the CPU under the
            # torch plane (so CPU tests run the same code)
            self._staged_path.active = self.device.type == "cuda" or plane.name == "torch"

    @property
    def deferred_updates(self) -> bool:
        """Whether the compiled plane's fused updates run on the store's apply worker,
        off the calling thread (:mod:`hiermem.dataplane.deferred`): the call returns once
        the gradients are checked, and the store's next call waits for the update.  Same
        numbers either way.  Default: on a CPU store where a core is free beside torch's
        intra-op threads (:func:`~hiermem.store.overlap.can_overlap`; Linux, JIT on): the
        worker spins on that core around each update's expected time."""
        return self._deferred.enabled

    @deferred_updates.setter
    def deferred_updates(self, on: bool) -> None:
        with self._lock:
            self._deferred.enabled = bool(on) and deferred_available()

    @property
    def defer_nonfinite(self) -> bool:
        """Check gradients for NaN/inf on the device, masking the update and raising at
        the next update or flush, instead of a host sync per update (default on CUDA;
        see docs/dataplane.md)."""
        return self._staged_path.defer_nonfinite

    @defer_nonfinite.setter
    def defer_nonfinite(self, on: bool) -> None:
        self._staged_path.defer_nonfinite = bool(on)

    @property
    def data_plane(self) -> str:
        """The data plane executing pooling and the fused optimizer (``"compiled"``: numba
        kernels, the default on CPU; ``"torch"``: torch ops, the default on CUDA and the
        reference).  Settable by name; both give the same numbers."""
        return self.plane.name

    @data_plane.setter
    def data_plane(self, name: str) -> None:
        plane = plane_named(name)
        with self._lock:
            self.plane = plane

    @timed("update_seconds")
    def update_with_row_stat(self, table: str, ids, grads: torch.Tensor, row_stat: torch.Tensor) -> None:
        """:meth:`update` of distinct rows whose optimizer statistic comes from outside.

        For a column shard of a table under an optimizer with a per-row statistic
        (:meth:`Optimizer.row_statistic`, e.g. row-wise Adagrad's ``mean(g*g)`` over the
        *full* row): ``row_stat [n]`` is that statistic reduced over every column shard,
        and ``grads [n, dim]`` this shard's columns of the summed gradients.

        Raises:
            InvalidArgumentError: ids repeat, ``row_stat`` has the wrong shape, or the
                optimizer has no per-row statistic.
            NonFiniteGradientError: NaN/inf in ``grads`` or ``row_stat``; nothing changed.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids = self._ids(ti, ids)
            grads = self._values(ti, ids.numel(), grads, "grads")
            row_stat = validate.check_row_stat(self.tables[ti], ids.numel(), row_stat, self.device)
            if self.optimizer.row_statistic(grads[:0], 1) is None:
                raise InvalidArgumentError(f"optimizer {self.optimizer.name} has no per-row statistic")
            if ids.numel() == 0:
                return
            b = self._batch(ti, ids)
            if b.k.numel() != ids.numel():
                raise InvalidArgumentError("update_with_row_stat needs distinct ids")
            p = self._place(b, account=False)
            self._steps[ti] += 1
            order = torch.empty_like(b.inverse).index_copy_(0, b.inverse, torch.arange(ids.numel()))
            order = order.to(self.device)  # the distinct rows' positions, in b.k order
            self.plane.apply_row_stat(self._view, p, ti, grads.index_select(0, order), row_stat.index_select(0, order))
            self.counters.add_io(IO.UPDATES, 1)
            self.counters.add_io(IO.UPDATED_ROWS, b.k.numel())

    def write(self, table: str, ids, values: torch.Tensor) -> None:
        """Set the weights of rows (e.g. to import an ``nn.EmbeddingBag``).

        Their optimizer state is reset to its initial value.  For duplicate ids the
        last value wins.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids = self._ids(ti, ids)
            values = self._values(ti, ids.numel(), values, "values")
            if ids.numel() == 0:
                return
            b = self._batch(ti, ids)
            p = self._place(b, account=False)
            dim, w = self.tables[ti].dim, self.widths[ti]
            rec = torch.full((b.k.numel(), w), self.optimizer.state_init(), dtype=torch.float32)
            rec[:, :dim] = values.cpu().index_select(0, b.lastpos)
            self._res.scatter(p, rec)

    def flush(self) -> None:
        """Write every dirty row to LMDB in one transaction and sync it to disk."""
        with self._lock:
            self._check_open()
            self._staged_path.check_deferred()
            allrows, parts = self._res.dirty_rows()
            self._flush_seq += 1  # the number read-only handles report (recorded with the rows)
            try:
                self._res.write_down(allrows, meta=True, sync=True)
            except BaseException:
                self._flush_seq -= 1
                raise
            self._res.mark_clean(parts)
            self.counters.add_io(IO.FLUSHES, 1)
            self.counters.add_io(IO.FLUSHED_ROWS, len(allrows))

    def close(self) -> None:
        """Flush and close.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self.stop_recording()
                self._staged_path.check_deferred(raise_=False)  # a refused update's step undone; nothing to raise into
                self.flush()
            finally:
                self._closed = True
                self._deferred.close()
                self._disk.close()
                locks.release_store(self.path, self._lockfd)
                from ..observe.metrics import STORES
                STORES.remove(self)

    def __enter__(self) -> "HierarchicalStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- introspection ------------------------------------------------------------------
    def where(self, table: str, ids) -> torch.Tensor:
        """The :class:`Tier` (as int64 codes) holding each row's latest value."""
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            return self._res.where(ti, self._ids(ti, ids))

    def stats(self, cumulative: bool = False) -> dict:
        """Counters per table and tier, plus store-wide I/O; see :mod:`hiermem.observe.stats`.

        Args:
            cumulative: count over the store's whole life (earlier sessions' counters are
                saved with its metadata at every flush and checkpoint), not this session's.
        """
        with self._lock:
            return store_stats(self, cumulative)

    def audit(self) -> None:
        """Check the internal invariants (a debugging aid; O(capacity);
        :meth:`Residency.audit <hiermem.store.residency.Residency.audit>` lists them).

        Raises:
            AssertionError: an invariant is broken.
        """
        with self._lock:
            self._res.audit()

    # -- checkpoints and whole-table transfers ---------------------------------------------
    def checkpoint(self, dest: str | os.PathLike) -> Path:
        """Flush, then snapshot the whole store into the new directory ``dest``.

        The snapshot holds every row's latest value (all tiers), the optimizer state and
        the layout.  It is written to a temporary directory and renamed into place, so
        ``dest`` appears complete or not at all.  Stale temporaries of killed
        checkpoints in ``dest``'s directory are removed first.

        Raises:
            HierMemError: ``dest`` exists.
            DiskFullError: no room for the copy (``dest`` is not created).
            StoreIOError: an I/O error writing it (``dest`` is not created).
        """
        dest = Path(dest).absolute()
        with self._lock:
            self._check_open()
            return self._checkpoints.take(dest, self.flush, self._disk.env)

    @classmethod
    def restore(cls, checkpoint: str | os.PathLike, path: str | os.PathLike, **overrides) -> "HierarchicalStore":
        """Replace the store at ``path`` by a copy of ``checkpoint`` and open it.

        ``path`` must not be open, in this process or another, for training or read-only;
        restore holds the store's lock from the check to the open, and the swap is one
        atomic rename of the data file, so a kill at any moment leaves the old store or
        the checkpoint.  ``overrides`` are as for :meth:`open`.

        Raises:
            StoreFormatError: ``checkpoint`` is not a store checkpoint, or ``path`` holds
                something else.
            HierMemError: ``path`` is open somewhere.
            DiskFullError, StoreIOError: copying failed (the store is untouched).
        """
        return restore_checkpoint(checkpoint, path, lambda: cls.open(path, **overrides))

    @property
    def stale_temporaries_removed(self) -> int:
        """Temporaries of killed checkpoints and restores removed (at open, and by
        checkpoints since)."""
        return self._checkpoints.stale_removed

    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of ``table`` that was ever written: ``(ids [n], records [n, width])``.

        Records are ``[weight | optimizer state]``; rows never written are not listed
        (their value is the initialiser's).  Flushes first.  Not a hot path: one LMDB
        cursor pass over the table's key range.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            self.flush()
            ids, rec = self._disk.committed_records(ti, self.widths[ti])
            return torch.from_numpy(ids), torch.from_numpy(rec)

    def import_records(self, table: str, ids: torch.Tensor, records: torch.Tensor) -> None:
        """Set whole records ``[n, width]`` (weights and optimizer state) of rows.

        Resident rows are overwritten in their slots (and marked dirty); the others are
        written straight to LMDB in one transaction, so importing a table larger than
        the tiers does not churn the cache.  For duplicate ids the last record wins.
        """
        with self._lock:
            self._check_open()
            ti = self.table_index(table)
            ids = self._ids(ti, ids)
            w = self.widths[ti]
            if not isinstance(records, torch.Tensor) or tuple(records.shape) != (ids.numel(), w):
                raise InvalidArgumentError(f"records of table {table} must have shape {(ids.numel(), w)}")
            rec = records.detach().to("cpu", torch.float32)  # indexed by the batch's CPU tensors
            if ids.numel() and not bool(torch.isfinite(rec).all()):
                raise NonFiniteGradientError(f"records of table {table} contain NaN or inf; nothing changed")
            if ids.numel() == 0:
                return
            b = self._batch(ti, ids)
            self._res.overwrite(ti, b, rec.index_select(0, b.lastpos))

    def clear(self) -> None:
        """Forget every row: all tables return to their initial values (LMDB emptied)."""
        with self._lock:
            self._check_open()
            # LMDB emptied first: a wipe that fails changes nothing; then the tiers forget
            self._res.clear(lambda: self._disk.clear_rows(meta=self._meta(), sync=False))
            self._memo = self._bags.memo = None
            self._disk.sync()  # a failed fsync raises with the store cleared all the same

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def flush_seq(self) -> int:
        """Flushes this store has completed over its life (read-only handles report it)."""
        return self._flush_seq

    def __repr__(self) -> str:
        return (f"HierarchicalStore({self.path}, tables={[s.name for s in self.tables]}, "
                f"device={self.device}, device_rows={self._dev.capacity}, host_rows={self._host.capacity}, "
                f"policy={self.policy.name}, optimizer={self.optimizer.name})")

    # -- trace capture (hiermem.sim) ------------------------------------------------------
    def record(self, path, updates: bool = True, chunk_accesses: int = 1 << 20) -> None:
        """Record every lookup batch, in batch order, to a trace (:mod:`hiermem.observe.trace`);
        ``updates``: a training trace.  Raises InvalidArgumentError when already recording."""
        from ..observe.trace import TraceRecorder

        with self._lock:
            self._check_open()
            if self._recorder is not None:
                raise InvalidArgumentError(f"already recording to {self._recorder.path}")
            self._recorder = TraceRecorder(path, [s.name for s in self.tables], updates=updates,
                                           chunk_accesses=chunk_accesses, source=f"store:{self.path}")

    def stop_recording(self) -> Path | None:
        """Finish the trace being recorded; returns its path (None when not recording)."""
        with self._lock:
            rec, self._recorder = self._recorder, None
            return rec.close() if rec is not None else None
