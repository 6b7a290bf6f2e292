"""The trace simulator: the store's control plane with no data plane.

It replays a trace through the *same* placement routine the store uses
(:func:`hiermem.store.placing.place`: :func:`hiermem.core.plan.decide`, the backing's
I/O, :func:`~hiermem.core.plan.commit`, over the same
:class:`~hiermem.tiers.SlotTier` state with zero-width records and policies built from
the same :class:`~hiermem.core.policies.PolicySpec`, counting into the same
:class:`~hiermem.observe.stats.Counters`), with two substitutions that need no data: the rows
are numbered densely per table (a direct index over the trace's distinct rows), and
LMDB is a bit per row ("has been written down": the
:class:`~hiermem.store.placing.WrittenRows` backing).  Replaying a trace captured from a
store reproduces the store's counters by construction; ``tests/test_sim_exact.py`` keeps
checking it against real stores.  A plain replay (no prefetch) is one compiled loop over
the whole trace (:func:`hiermem.core.replay.replay`): no Python per batch or access.

Prefetch depth ``k`` runs the store's own prefetch code (:class:`~hiermem.store.multi.Prefetches`:
admission, tickets, pins, revoke-and-retry, prefetch hits) in the pipeline's order
(``P(0..k-1)``, then per step ``L(i)``, ``P(i+k)``, ``U(i)``, ``R(i)``): ``P(j)`` admits a
batch only if its rows (those not pinned on the device already) fit on the device beside
the rows pinned there and twice beside all pinned rows, then places it with
full accounting and pins its rows where they land (refused or a ``CapacityError``: pins
nothing, *degraded*, and ``L(j)`` is then a plain accounted lookup); ``L(i)`` of a pinned
batch uses its rows where they are pinned (device or host), moving nothing; a lookup that cannot fit beside the pins
revokes them all; ``U(i)`` re-places the rows (unaccounted) only if rows changed tier
since ``L(i)`` and the batch is not pinned; ``R(i)`` unpins.  The same counters come out
(``PREFETCH_*`` included): ``tests/test_sim_exact.py`` replays traces a store captured
through ``prefetch``/``lookup_bags``/``update_bags``/``release`` at depths 0..3.

Policies that want lookahead (``wants_lookahead``) get :meth:`on_lookahead` before each
accounted lookup of batch ``j`` when prefetching (``k > 0``): the resident rows that
batches ``j+1 .. j+window`` use (``window`` a policy parameter, default ``k``), i.e. what a
data pipeline that reads ids ``window`` batches ahead knows.  With ``k = 0`` they get no
calls (as plain store lookups), so they run as their base policy.

Not thread-safe; a simulator owns all its state.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, Union

import numpy as np
import torch

from ..errors import CapacityError, InvalidArgumentError, InvalidTypeError
from ..core.policies import PolicySpec, resolve_policy
from ..core import plan as _plan
from ..core.index import KeyIndex
from ..core.jit import announce_compile
from ..core.names import M
from ..core.replay import PIPELINE_IDS, rank_dense, replay, replay_pipelined
from ..core.sketch import row_hashes
from ..observe.stats import IO, STAT_TIERS, Counters, Stat
from ..tiers.slots import SlotTier
from ..types import Tier
from .cost import CostModel, StepTime
from ..observe.trace import Trace, load_trace
from ..store.hierarchical import HierarchicalStore
from ..store.multi import Prefetches, Ticket, prefetch_order
from ..store.placed import Batch, Placement
from ..store.placing import Workspace, WrittenRows, placement
from ..store.residency import locate, tier_parts
from ..store.warm import ensure_compiled

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class SimConfig:
    """What to simulate.

    Args:
        device_rows: slots of the device tier.
        host_rows: slots of the host tier (0: none, device victims go to disk; the
            store itself needs at least 1).
        policy: a policy name, a policy TOML file, or a :class:`PolicySpec`.
        prefetch_depth: batches prefetched (and pinned) ahead; 0 = plain lookups.
        updates: rows become dirty after each batch (None: the trace's own flag).
        row_bytes: bytes of one row record (weights + optimizer state) for bytes moved.
        cost: the cost model turning bytes moved into an estimated step time.
        pipeline: (no prefetch) deduplicate each batch a batch ahead on a second thread;
            None: where torch has more than one thread and batches average at least
            ``hiermem.core.replay.PIPELINE_IDS`` ids.  The numbers are the same either way.
        lookahead: when a ``wants_lookahead`` policy learns the window's batches.  None:
            as a store does, from its prefetch pipeline (depth > 0; plain lookups give the
            base policy); True: at any depth, plain lookups included (the trace is known:
            an offline oracle, e.g. against Belady per access).
    """

    device_rows: int
    host_rows: int = 0
    policy: Union[str, os.PathLike, PolicySpec] = "lru"
    prefetch_depth: int = 0
    updates: Optional[bool] = None
    row_bytes: int = 256
    cost: CostModel = field(default_factory=CostModel)
    pipeline: Optional[bool] = None
    lookahead: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("device_rows", "host_rows", "row_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidTypeError(f"{name} must be an int, got {type(v).__name__}")
            lo = 0 if name == "host_rows" else 1
            if v < lo:
                raise InvalidArgumentError(f"{name} must be >= {lo}, got {v}")
        k = self.prefetch_depth
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidArgumentError(f"prefetch_depth must be an int >= 0, got {k!r}")
        for name in ("updates", "pipeline", "lookahead"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidTypeError(f"{name} must be a bool or None")

    def policy_spec(self) -> PolicySpec:
        return self.policy if isinstance(self.policy, PolicySpec) else resolve_policy(self.policy)


@dataclass
class SimResult:
    """Counters of one simulation, laid out as the store's ``stats()``.

    Attributes:
        counters: the same ``table x tier x Stat`` and ``IO`` tensors the store keeps.
        accesses: ids looked up (duplicates included); batches: batches replayed.
        degraded: prefetched batches refused or not entirely on the device (the store's
            ``PREFETCH_DEGRADED``).
        seconds: wall time of the replay.
        step: estimated time per training step from the cost model.
    """

    tables: tuple[str, ...]
    counters: Counters
    accesses: int
    batches: int
    degraded: int
    seconds: float
    step: StepTime
    policy: str
    device_rows: int
    host_rows: int
    prefetch_depth: int

    def tier(self, tier: Tier) -> dict:
        tot = self.counters.table[:, tier].sum(0)
        return {s.name.lower(): int(tot[s]) for s in Stat}

    @property
    def device_hits(self) -> int:
        return int(self.counters.table[:, Tier.DEVICE, Stat.HITS].sum())

    @property
    def device_misses(self) -> int:
        return int(self.counters.table[:, Tier.DEVICE, Stat.MISSES].sum())

    @property
    def hit_rate(self) -> float:
        return self.device_hits / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        io = self.counters.io
        return {
            "accesses": self.accesses, "batches": self.batches, "policy": self.policy,
            "device_rows": self.device_rows, "host_rows": self.host_rows, "prefetch_depth": self.prefetch_depth,
            **{t.label: self.tier(t) for t in STAT_TIERS},
            "device_hit_rate": self.hit_rate,
            "bytes": {k.name.lower().removeprefix("bytes_"): int(io[k]) for k in IO if k.name.startswith("BYTES")},
            "degraded_batches": self.degraded,
            "est_step_seconds": self.step.total, "est_step": self.step.to_dict(),
            "sim_seconds": self.seconds,
            "tables": {name: {t.label: {s.name.lower(): int(self.counters.table[i, t, s]) for s in Stat}
                              for t in STAT_TIERS} for i, name in enumerate(self.tables)},
        }


def _rank(ids: np.ndarray, out: np.ndarray | None = None, base: int = 0) -> tuple[np.ndarray, int]:
    """Each id's rank among the distinct ids (as ``np.unique``'s inverse) plus ``base``,
    written to ``out`` (a new array if None), and the number of distinct ids."""
    out = np.empty(ids.size, dtype=np.int64) if out is None else out
    if not ids.size:
        return out, 0
    hi = int(ids.max())
    if hi <= 4 * ids.size + (1 << 16):  # dense enough: a presence table, O(n + max), compiled
        return out, int(rank_dense(ids, hi, out, base))
    u, inv = np.unique(ids, return_inverse=True)
    out[:] = inv.reshape(-1) + base
    return out, u.size


def dense_rows(trace: Trace, keep_ids: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each access's row as a dense number over ``(table, id)`` (in that sorted order),
    and the table of each dense row.  ``keep_ids``: a single table whose ids all lie in
    ``[0, accesses)`` keeps them as its row numbers (rows no access uses included: no
    array longer than the trace, and no ranking pass, ~9 ns an access)."""
    single = len(trace.tables) == 1
    if single and keep_ids and trace.ids.size and trace.ids.dtype == np.int64:
        lo, hi = int(trace.ids.min()), int(trace.ids.max())
        if lo >= 0 and hi < trace.ids.size:
            return np.ascontiguousarray(trace.ids), np.zeros(hi + 1, dtype=np.int64)
    tab = None if single else trace.table_of_ids()
    dense = np.empty(trace.accesses, dtype=np.int64)
    tables_of_rows, base = [], 0
    for t in range(len(trace.tables)):
        m = slice(None) if single else tab == t
        ids = trace.ids[m]
        if not ids.size:
            continue
        if single:  # straight into the result: no temporaries (a trace's ids are 80 MB per 10M)
            _, nu = _rank(ids, dense, base)
        else:
            inv, nu = _rank(ids, None, base)  # dense order = (table, id) order
            dense[m] = inv
        tables_of_rows.append(np.full(nu, t, dtype=np.int64))
        base += nu
    return dense, (np.concatenate(tables_of_rows) if tables_of_rows else np.zeros(0, dtype=np.int64))


class _Batches:
    """A trace with dense row numbers: per batch its distinct rows, counts, last positions."""

    def __init__(self, trace: Trace):
        dense, table_of_row = dense_rows(trace, keep_ids=True)
        self.num_rows = table_of_row.size
        self.table_of_row = torch.from_numpy(table_of_row)
        self._offsets = None
        sizes = np.bincount(table_of_row, minlength=len(trace.tables)) if table_of_row.size else \
            np.zeros(len(trace.tables), dtype=np.int64)
        self.sizes = [int(x) for x in sizes]
        self.row_base = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        self.dense = torch.from_numpy(dense)
        self.offsets_np = trace.batch_offsets
        self.n = trace.num_batches
        self.max_batch = int(np.diff(self.offsets_np).max()) if self.n else 1
        self._ids = trace.ids

    def row_hashes(self) -> np.ndarray:
        """Each dense row's hash as the store computes it, of its table and id
        (:func:`hiermem.core.sketch.rowhash`): queue policies and the admission filter
        then know a row by the same hash as in the store that captured the trace."""
        ids = np.zeros(self.num_rows, dtype=np.int64)
        ids[self.dense.numpy()] = self._ids  # every access writes its row's id
        out = np.empty(self.num_rows, dtype=np.int64)
        row_hashes(self.table_of_row.numpy(), ids, out)
        return out

    @property
    def offsets(self) -> list[int]:
        """Batch offsets as Python ints (the prefetch replay's per-batch slicing)."""
        if self._offsets is None:
            self._offsets = self.offsets_np.tolist()
        return self._offsets

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(rows, counts, lastpos, n)`` of batch ``i`` (as ``HierarchicalStore._batch``)."""
        ids = self.dense[self.offsets[i]:self.offsets[i + 1]]
        n = ids.numel()
        s, perm = torch.sort(ids, stable=True)  # one sort: rows, counts and last positions
        new = torch.ones(n, dtype=torch.bool)
        new[1:] = s[1:] != s[:-1]
        starts = new.nonzero().squeeze(1)
        ends = torch.cat((starts[1:], torch.tensor([n])))
        return s.index_select(0, starts), ends - starts, perm.index_select(0, ends - 1), n

    def rows(self, i: int) -> torch.Tensor:
        """Distinct rows of batch ``i``."""
        return torch.unique(self.dense[self.offsets[i]:self.offsets[i + 1]])


class _Tiers:
    """What the store's :class:`~hiermem.store.multi.Prefetches` reads of a residency
    (its index, its two tiers, where placed rows are), over the simulator's tiers."""

    device = _CPU

    def __init__(self, keys: KeyIndex, dev: SlotTier, host: SlotTier):
        self.keys, self.dev, self.host = keys, dev, host
        self.tiers = (dev, host)

    def parts(self, p: Placement) -> list:
        """``(tier, slots, idx, cpu slots)`` per tier holding rows of ``p`` (all on the CPU)."""
        return tier_parts(self.dev, self.host, p, _CPU)

    def locate(self, b: Batch) -> Placement | None:
        return locate(self.keys, self.dev.capacity, b)


class Simulator:
    """Replay a trace through a device tier, a host tier and a written-rows bitmap.

    Args:
        trace: a :class:`Trace` or the path of a trace directory.
        config: tier sizes, policy, prefetch depth.
    """

    def __init__(self, trace: Union[Trace, str, os.PathLike], config: SimConfig):
        if not isinstance(config, SimConfig):
            raise InvalidTypeError("config must be a hiermem.sim.SimConfig")
        ensure_compiled(store_class=HierarchicalStore)  # the first use compiles the kernels, once
        self.trace = trace if isinstance(trace, Trace) else load_trace(trace)
        self.config = config
        self.spec = config.policy_spec()
        self.updates = self.trace.updates if config.updates is None else config.updates
        self.b = _Batches(self.trace)
        D, H = config.device_rows, config.host_rows
        self._keys = KeyIndex(D + H, [max(1, n) for n in self.b.sizes] or [1], direct=True)
        self._dev = SlotTier(Tier.DEVICE, D, 0, _CPU, self.spec, base=0)
        self._host = SlotTier(Tier.HOST, H, 0, _CPU, self.spec, base=D)
        self._written = np.zeros(self.b.num_rows, dtype=np.uint8)  # has an LMDB copy
        # the store's row hashes, where a policy knows rows by them
        hashes = self._dev.policy.hashes or self._host.policy.hashes
        self._row_hash = self.b.row_hashes() if hashes else np.zeros(1, dtype=np.int64)
        self._work = Workspace()
        self._epoch = 0
        self.counters = Counters(len(self.trace.tables))
        self._io = self.counters.io.numpy()
        self._table = self.counters.table.numpy()
        self._backing = WrittenRows(self._dev, self._host, self.b.row_base, self._written, self._io, config.row_bytes,
                                    self._row_hash)
        self._tiers = _Tiers(self._keys, self._dev, self._host)
        self._prefetches = Prefetches(self._tiers, self.counters, None)  # the store's: admission, pins, revokes
        self._clock = 0
        self.degraded = 0
        self._window = int(getattr(self._dev.policy, "window", 0) or 0) or config.prefetch_depth
        # future ids come from a prefetch pipeline, as in the store, unless asked for at
        # any depth (the trace is known)
        self._lookahead = self._dev.policy.wants_lookahead and (config.prefetch_depth > 0 or bool(config.lookahead))
        if self._lookahead:
            self._lookahead_pairs()

    # -- the store's rule -------------------------------------------------------------
    def _batch(self, i: int) -> Batch:
        """Batch ``i`` as the store's :class:`Batch` (index keys ``(table, row within it)``)."""
        rows, counts, lastpos, n = self.b.get(i)
        k = rows.numpy()
        t = self.b.table_of_row.numpy()[k]
        return Batch(torch.from_numpy(t), torch.from_numpy(k - self.b.row_base[t]), None, counts, lastpos, n)

    def _resolve(self, b: Batch, clock: torch.Tensor, account: bool) -> Placement:
        """The store's placement (:func:`hiermem.store.placing.place`) with its other
        backing: "written to LMDB" a bit per row.  An unaccounted resolve (a revoked
        batch's lookup, an update after a tier change) moves rows but never "uses" them."""
        ws, res = self._backing.place(self._keys.arrays, self._work, b, clock.numpy(), b.counts.numpy(), account,
                                      self._table)
        if res[M]:
            self._epoch += 1  # rows changed tier (the store's memo epoch)
        return placement(ws, res, b.k.numel(), self._dev.capacity)

    def _place(self, i: int, b: Batch, account: bool, record: bool = True, extra=None) -> Placement:
        """``HierarchicalStore._place`` of batch ``i``: accounted (the clock moves on once
        it is placed: a refused batch leaves no trace), or not."""
        if not account:
            return self._resolve(b, torch.full_like(b.k, self._clock), False)
        if self._lookahead:
            self._mark_lookahead(i)
        p = self._resolve(b, b.lastpos + self._clock, True)
        self._clock += b.n
        return p

    @property
    def _pinned_rows(self) -> int:
        return self._dev.pinned + self._host.pinned

    def _update(self, p: Placement) -> None:
        if self.updates:
            if p.on_device is None:
                self._dev.dirty[p.slot] = True
            else:
                self._dev.dirty[p.slot[p.on_device]] = True
                self._host.dirty[p.slot[~p.on_device]] = True
            self._io[IO.UPDATES] += 1
            self._io[IO.UPDATED_ROWS] += p.slot.numel()

    def _lookahead_pairs(self) -> None:
        """Each batch's distinct rows, batch by batch (``_pair_row``, offsets ``_pair_off``),
        for the window's next uses."""
        b = self.b
        bat = np.repeat(np.arange(b.n, dtype=np.int64), np.diff(b.offsets_np))
        key = np.unique(bat * max(1, b.num_rows) + b.dense.numpy())  # (batch, row), batch-major
        self._pair_bat = key // max(1, b.num_rows)
        self._pair_row = key % max(1, b.num_rows)
        self._pair_off = np.searchsorted(self._pair_bat, np.arange(b.n + 1, dtype=np.int64))
        self._nx = np.full(b.num_rows, -1, dtype=np.int64)

    def _mark_lookahead(self, i: int) -> None:
        """Tell the policies which resident rows batches ``i+1 .. i+window`` use, and how
        many batches ahead each is next used (as the prefetch pipeline tells the store)."""
        lo, hi = self._pair_off[min(i + 1, self.b.n)], self._pair_off[min(i + self._window, self.b.n - 1) + 1]
        rows, first = np.unique(self._pair_row[lo:hi], return_index=True)  # batch-major: the first use
        nx = self._nx
        nx[rows] = self._pair_bat[lo:hi][first] - i
        for tier in (self._dev, self._host):
            kt = tier.keys_t.numpy()
            occ = np.flatnonzero(kt >= 0)
            r = self.b.row_base[kt[occ]] + tier.keys_k.numpy()[occ]
            w = nx[r]
            sel = w > 0
            tier.policy.on_lookahead(occ[sel], w[sel])
        nx[rows] = -1

    def _run_plain(self, threads: int) -> None:
        """Every batch in one compiled loop (:func:`hiermem.core.replay.replay`); with
        ``threads > 1`` and large batches, each batch's dedup runs a batch ahead on a
        second thread (:func:`~hiermem.core.replay.replay_pipelined`, same numbers)."""
        if self._lookahead:  # the policy learns the window before each batch: one batch a call
            off = self.b.offsets_np
            for i in range(self.b.n):
                if off[i + 1] > off[i]:
                    p = self._place(i, self._batch(i), True)
                    if self.updates:
                        self._update(p)
            return
        b, dev, host = self.b, self._dev, self._host
        announce_compile(replay, "the simulator's replay loop")  # not warmed at import: ~20 s, once
        lens = np.diff(b.offsets_np)
        multi = lens[lens > 1]
        pipelined = (self.config.pipeline if self.config.pipeline is not None else
                     threads > 1 and multi.size > 1 and multi.mean() >= PIPELINE_IDS)
        out = (replay_pipelined if pipelined else replay)(
            self._keys.arrays, dev.state, dev.policy.state, host.state, host.policy.state,
            b.dense.numpy(), b.offsets_np, b.table_of_row.numpy(), b.row_base, self._row_hash,
            self._written, bool(self.updates), self.counters.table.numpy(), self._io,
            self.config.row_bytes, *_plan.workspace(b.max_batch), self._clock)
        if out < 0:
            i = -1 - out
            raise CapacityError(f"batch {i} needs more rows resident at once than the device ({dev.capacity}) "
                                f"and host ({host.capacity}) tiers hold")
        self._clock = out

    def _prefetch(self, j: int) -> Ticket:
        """``HierarchicalStore.prefetch`` of batch ``j`` (the store's own admission,
        accounted placement and pins: :meth:`~hiermem.store.multi.Prefetches.prefetch`)."""
        b = self._batch(j)
        return self._prefetches.prefetch(b if b.n else None, None, None, partial(self._place, j))

    def _run_prefetch(self, depth: int) -> None:
        """The pipeline's order (:func:`~hiermem.store.multi.prefetch_order`, the rule the
        pipeline's threads follow) over the store's own steps: P is ``prefetch``, L
        ``lookup_bags``'s placement, U ``update_bags``'s, R ``release``."""
        pf, live, step = self._prefetches, {}, {}
        for op, i in prefetch_order(self.b.n, depth, lambda i: live[i]):
            if op == "P":
                live[i] = self._prefetch(i)
                continue
            tk = live[i]
            b, place = tk.batch, partial(self._place, i)
            if op == "L" and tk.ids:  # pinned rows where they are; else placed (revoking the pins if need be)
                step[i] = (pf.place_batch(b, tk, None, place), self._epoch)
            elif op == "U" and tk.ids:  # the lookup's placement unless rows moved since (then re-placed)
                p, epoch = step.pop(i)
                if tk.pinned:
                    p = self._tiers.locate(b)
                elif self._epoch != epoch:
                    p = pf.retry(lambda: place(b, account=False))
                self._update(p)
            elif op == "R":
                tk.released = True
                pf.release(live.pop(i))

    def run(self) -> SimResult:
        """Replay the whole trace once.

        Raises:
            CapacityError: (prefetch depth 0) a batch has more distinct rows than the
                device and host tiers hold, as the store would raise.
        """
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # per-batch ops are small: intra-op threads only add sync waits
        try:
            if self.config.prefetch_depth:
                self._run_prefetch(self.config.prefetch_depth)
            else:
                self._run_plain(threads)
        finally:
            torch.set_num_threads(threads)
        self.degraded = int(self.counters.io[IO.PREFETCH_DEGRADED])
        secs = time.perf_counter() - t0
        io = self.counters.io
        step = self.config.cost.estimate(
            batches=self.b.n, accesses=self.trace.accesses,
            bytes_h2d=int(io[IO.BYTES_HOST_TO_DEVICE]), bytes_d2h=int(io[IO.BYTES_DEVICE_TO_HOST]),
            bytes_disk_read=int(io[IO.BYTES_DISK_TO_HOST]), bytes_disk_write=int(io[IO.BYTES_HOST_TO_DISK]),
            prefetch_depth=self.config.prefetch_depth)
        return SimResult(self.trace.tables, self.counters, self.trace.accesses, self.b.n, self.degraded, secs, step,
                         self.spec.name, self.config.device_rows, self.config.host_rows, self.config.prefetch_depth)


def simulate(trace: Union[Trace, str, os.PathLike], config: SimConfig) -> SimResult:
    """Replay ``trace`` under ``config`` (see :class:`Simulator`)."""
    return Simulator(trace, config).run()
