"""The trace simulator: the store's placement rule over zero-width rows.

It replays a trace at batch granularity through the *same* tier and policy classes the
store uses (:class:`~hiermem.tiers.SlotTier` with zero-width records, policies built from
the same :class:`~hiermem.eviction.PolicySpec`, the same :class:`~hiermem.stats.Counters`),
with two substitutions that make it fast and need no disk: the key -> slot index is a
dense array over the trace's distinct rows (``DenseIndex``), and LMDB is a bit per row
("has been written down").  :meth:`Simulator._resolve` follows
``HierarchicalStore._resolve`` step by step (same victims, same order, same free-slot
order), so replaying a trace captured from a store reproduces the store's counters
exactly; ``tests/test_sim_exact.py`` checks this against real stores.

Prefetch depth ``k`` follows ``HierarchicalStore.prefetch`` and the pipeline's order
(``P(0..k-1)``, then per step ``L(i)``, ``P(i+k)``, ``U(i)``, ``R(i)``): ``P(j)`` admits a
batch only if its rows fit on the device beside the rows pinned there and twice beside
all pinned rows, then places it with
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
from typing import Optional, Union

import numpy as np
import torch

from ..errors import CapacityError, InvalidArgumentError, InvalidTypeError
from ..eviction import PolicySpec, resolve_policy
from ..stats import IO, STAT_TIERS, Counters, Stat
from ..tiers.slots import Rows, SlotTier
from ..types import Tier
from .cost import CostModel, StepTime
from .trace import Trace, load_trace

_CPU = torch.device("cpu")


class DenseIndex:
    """The :class:`~hiermem.index.SlotIndex` interface over dense row numbers ``k``.

    ``loc[k]`` is the global slot of row ``k`` (-1: not resident); ``t`` is ignored
    because dense numbers are already distinct across tables.
    """

    def __init__(self, num_rows: int, capacity: int):
        self.device = _CPU
        self.loc = torch.full((num_rows,), -1, dtype=torch.int64)
        self.key_of = torch.zeros(capacity, dtype=torch.int64)
        self.size = 0

    def find(self, t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.loc.index_select(0, k)

    def insert(self, t: torch.Tensor, k: torch.Tensor, slots: torch.Tensor) -> None:
        self.loc[k] = slots
        self.key_of[slots] = k
        self.size += k.numel()

    def remove_slots(self, slots: torch.Tensor) -> None:
        self.loc[self.key_of.index_select(0, slots)] = -1
        self.size -= slots.numel()

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        ks = self.key_of.index_select(0, src)
        self.loc[ks] = dst
        self.key_of[dst] = ks


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
    """

    device_rows: int
    host_rows: int = 0
    policy: Union[str, os.PathLike, PolicySpec] = "lru"
    prefetch_depth: int = 0
    updates: Optional[bool] = None
    row_bytes: int = 256
    cost: CostModel = field(default_factory=CostModel)

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
        if self.updates is not None and not isinstance(self.updates, bool):
            raise InvalidTypeError("updates must be a bool or None")

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


class _Tally:
    """The ``Counters`` bumps of a replay, as plain Python ints while one table is
    replayed (a tensor op per bump costs more than the bump); copied out at the end."""

    def __init__(self, num_tables: int):
        self.T = num_tables
        self.table = np.zeros((num_tables, len(STAT_TIERS), len(Stat)), dtype=np.int64)
        self.io = [0] * len(IO)
        self._one = [[0] * len(Stat) for _ in STAT_TIERS] if num_tables == 1 else None

    def add(self, tier: Tier, stat: Stat, t: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        if self._one is not None:
            self._one[tier][stat] += t.numel() if weights is None else int(weights.sum())
        elif t.numel():
            self.table[:, tier, stat] += torch.bincount(t, weights=weights, minlength=self.T).long().numpy()

    def into(self, c: Counters) -> None:
        if self._one is not None:
            self.table[0] = np.array(self._one)
        t = self.table.copy()
        t[:, Tier.DEVICE, Stat.HITS] = t[:, Tier.DEVICE, Stat.LOOKUPS] - t[:, Tier.DEVICE, Stat.MISSES]
        t[:, Tier.HOST, Stat.LOOKUPS] = t[:, Tier.DEVICE, Stat.MISSES]
        t[:, Tier.HOST, Stat.HITS] = t[:, Tier.HOST, Stat.LOOKUPS] - t[:, Tier.HOST, Stat.MISSES]
        c.table.copy_(torch.from_numpy(t))
        c.io.copy_(torch.tensor(self.io, dtype=torch.int64))


def _rank(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Each id's rank among the distinct ids (as ``np.unique``'s inverse), and their number."""
    hi = int(ids.max())
    if hi <= 4 * ids.size + (1 << 16):  # dense enough: a presence table, O(n + max)
        present = np.zeros(hi + 1, dtype=np.int64)
        present[ids] = 1
        rank = np.cumsum(present) - 1
        return rank[ids], int(rank[-1]) + 1
    u, inv = np.unique(ids, return_inverse=True)
    return inv.reshape(-1), u.size


def dense_rows(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Each access's row as a dense number over ``(table, id)`` (in that sorted order),
    and the table of each dense row."""
    single = len(trace.tables) == 1
    tab = None if single else trace.table_of_ids()
    dense = np.empty(trace.accesses, dtype=np.int64)
    tables_of_rows, base = [], 0
    for t in range(len(trace.tables)):
        m = slice(None) if single else tab == t
        ids = trace.ids[m]
        if not ids.size:
            continue
        inv, nu = _rank(ids)  # dense order = (table, id) order
        dense[m] = inv + base
        tables_of_rows.append(np.full(nu, t, dtype=np.int64))
        base += nu
    return dense, (np.concatenate(tables_of_rows) if tables_of_rows else np.zeros(0, dtype=np.int64))


class _Batches:
    """A trace with dense row numbers: per batch its distinct rows, counts, last positions."""

    def __init__(self, trace: Trace):
        dense, table_of_row = dense_rows(trace)
        self.num_rows = table_of_row.size
        self.table_of_row = torch.from_numpy(table_of_row)
        self.dense = torch.from_numpy(dense)
        self.offsets = trace.batch_offsets.tolist()
        self.n = trace.num_batches

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


@dataclass
class _Ticket:
    """A prefetched batch (the store's ``Ticket``): its rows, pinned / accounted state."""

    batch: tuple
    pinned: bool
    accounted: bool
    released: bool = False


def _count(ev) -> int:
    """Evictable slots of a mask or an :class:`~hiermem.eviction.Evictable`."""
    return int(ev.sum()) if isinstance(ev, torch.Tensor) else ev.count


class Simulator:
    """Replay a trace through a device tier, a host tier and a written-rows bitmap.

    Args:
        trace: a :class:`Trace` or the path of a trace directory.
        config: tier sizes, policy, prefetch depth.
    """

    def __init__(self, trace: Union[Trace, str, os.PathLike], config: SimConfig):
        if not isinstance(config, SimConfig):
            raise InvalidTypeError("config must be a hiermem.sim.SimConfig")
        self.trace = trace if isinstance(trace, Trace) else load_trace(trace)
        self.config = config
        self.spec = config.policy_spec()
        self.updates = self.trace.updates if config.updates is None else config.updates
        self.b = _Batches(self.trace)
        D, H = config.device_rows, config.host_rows
        self._keys = DenseIndex(self.b.num_rows, D + H)
        self._dev = SlotTier(Tier.DEVICE, D, 0, _CPU, self.spec, self._keys, base=0)
        self._host = SlotTier(Tier.HOST, H, 0, _CPU, self.spec, self._keys, base=D)
        self._written = torch.zeros(self.b.num_rows, dtype=torch.bool)  # has an LMDB copy
        self._pins = torch.zeros(self.b.num_rows, dtype=torch.int32)
        self._pinned_rows = 0  # distinct rows with a pin
        self._epoch = 0
        self.counters = Counters(len(self.trace.tables))
        self._tally = _Tally(len(self.trace.tables))
        self._clock = 0
        self.degraded = 0
        self._window = int(getattr(self._dev.policy, "window", 0) or 0) or config.prefetch_depth
        # future ids are known only to a prefetch pipeline: no lookahead with plain lookups
        self._lookahead = self._dev.policy.wants_lookahead and config.prefetch_depth > 0
        self._soon = torch.zeros(self.b.num_rows, dtype=torch.int32) if self._lookahead else None
        self._soon_in: set[int] = set()  # the batches counted in _soon

    # -- the store's rule -------------------------------------------------------------
    @staticmethod
    def _new_rows(t: torch.Tensor, k: torch.Tensor) -> Rows:
        """Clean zero-width rows entering from disk (or the initialiser)."""
        n = k.numel()
        return Rows(t, k, torch.empty((n, 0)), torch.zeros(n, dtype=torch.bool))

    def _evictable(self, tier: SlotTier, exclude: torch.Tensor):
        """What ``tier`` may evict: per slot (the policy's reservoir, no pass over the
        tier) while no row is pinned, else as a mask over the tier."""
        if not self._pinned_rows:
            return tier.candidates(exclude)
        m = tier.keys_t >= 0
        m &= self._pins.index_select(0, tier.keys_k) == 0
        m[exclude] = False
        return m

    def _account_lookups(self, t: torch.Tensor, counts: torch.Tensor, mi: torch.Tensor) -> None:
        """Device lookups and misses (hits and host lookups follow from them)."""
        self._tally.add(Tier.DEVICE, Stat.LOOKUPS, t, counts)
        self._tally.add(Tier.DEVICE, Stat.MISSES, t[mi])

    def _account_disk(self, t: torch.Tensor, found: torch.Tensor) -> None:
        """Host misses = disk lookups; disk hits (rows written before) and misses."""
        c = self._tally
        c.add(Tier.HOST, Stat.MISSES, t)
        c.add(Tier.DISK, Stat.LOOKUPS, t)
        c.add(Tier.DISK, Stat.HITS, t[found])
        c.add(Tier.DISK, Stat.MISSES, t[~found])

    def _resolve(self, k: torch.Tensor, counts: torch.Tensor, clock: torch.Tensor,
                 account: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``HierarchicalStore._resolve`` over dense rows ``k``: returns ``(slot, on_device)``.

        An unaccounted resolve (a prefetched batch's lookup, an update after a tier change)
        moves rows but never "uses" them: moved rows keep their carried policy state.
        """
        dev, host, row = self._dev, self._host, self.config.row_bytes
        t = self.b.table_of_row.index_select(0, k)
        g = self._keys.loc.index_select(0, k)
        in_dev = (g >= 0) & (g < dev.capacity)
        dslot = torch.where(in_dev, g, -1)
        hit_slots = dslot[in_dev]
        mi = (~in_dev).nonzero().squeeze(1)
        M = mi.numel()
        if M == 0:
            if account:
                dev.policy.on_access(hit_slots, clock, counts)
                self._account_lookups(t, counts, mi)
            return dslot, in_dev
        mt, mk, mclock, mcount = t[mi], k[mi], clock[mi], counts[mi]
        hs = g[mi] - host.base
        m_host = hs >= 0
        ev_d = None if M <= dev.nfree else self._evictable(dev, hit_slots)
        n_move = M if ev_d is None else min(M, dev.nfree + _count(ev_d))
        m_move = torch.arange(M) < n_move
        A, B = m_move & m_host, m_move & ~m_host
        C, E = ~m_move & m_host, ~m_move & ~m_host
        n_vd = max(0, n_move - dev.nfree)
        nA, nE = int(A.sum()), int(E.sum())
        if n_vd + nE <= host.nfree + nA:
            ev_h, room_h = None, host.nfree + nA - nE
        else:
            ev_h = self._evictable(host, hs[m_host])
            room_h = host.nfree + nA + _count(ev_h) - nE
        if room_h < 0:
            raise CapacityError(f"batch needs {M + hit_slots.numel()} rows resident at once; device ({dev.capacity}) "
                                f"and host ({host.capacity}) tiers cannot hold them with their pinned rows")
        vd = dev.policy.victims(n_vd, ev_d) if n_vd else dev.no_slots
        n_skip = max(0, n_vd - room_h)
        vd_disk, vd_host = vd[:n_skip], vd[n_skip:]
        n_vh = max(0, vd_host.numel() + nE - host.nfree - nA)
        vh = host.policy.victims(n_vh, ev_h) if n_vh else host.no_slots
        ondisk = ~m_host
        found = self._written.index_select(0, mk[ondisk])
        io = self._tally.io
        io[IO.BYTES_DISK_TO_HOST] += int(found.sum()) * row
        if account:
            dev.policy.on_access(hit_slots, clock[in_dev], counts[in_dev])
            self._account_lookups(t, counts, mi)
            self._account_disk(mt[ondisk], found)
        self._epoch += 1  # rows change tier from here on (the store's memo epoch)
        wb = torch.cat((host.keys_k[vh[host.dirty[vh]]], dev.keys_k[vd_disk[dev.dirty[vd_disk]]]))
        if wb.numel():
            self._written[wb] = True
            io[IO.BYTES_HOST_TO_DISK] += wb.numel() * row
        # ---- mutate (as the store) ----------------------------------------------
        for tier, slots in ((host, vh), (dev, vd_disk)):
            gone = tier.take(slots, with_records=False)
            self._tally.add(tier.tier, Stat.EVICTIONS, gone.t)
            self._tally.add(tier.tier, Stat.WRITEBACKS, gone.t[gone.dirty])
        up = host.take(hs[A], unindex=False)  # zero-width records
        down = dev.take(vd_host, unindex=False)
        self._tally.add(Tier.DEVICE, Stat.EVICTIONS, down.t)
        self._tally.add(Tier.DEVICE, Stat.WRITEBACKS, down.t[down.dirty])
        iA, iB = A.nonzero().squeeze(1), B.nonzero().squeeze(1)
        io[IO.BYTES_DEVICE_TO_HOST] += len(down) * row
        io[IO.BYTES_HOST_TO_DEVICE] += (len(up) + iB.numel()) * row
        sA = dev.put(up, index=False)
        sD = host.put(down, index=False)
        self._keys.move_slots(torch.cat((host.g(hs[A]), dev.g(vd_host))), torch.cat((dev.g(sA), host.g(sD))))
        if account:
            dev.policy.on_access(sA, mclock[iA], mcount[iA])
        slot = dslot.clone()
        on_device = torch.ones_like(in_dev)
        slot[mi[iA]] = sA
        sB = dev.put(self._new_rows(mt[iB], mk[iB]),
                     mclock[iB], mcount[iB])
        slot[mi[iB]] = sB
        iC, iE = C.nonzero().squeeze(1), E.nonzero().squeeze(1)
        if iC.numel() or iE.numel():
            if account:
                host.policy.on_access(hs[iC], mclock[iC], mcount[iC])
            sE = host.put(self._new_rows(mt[iE], mk[iE]),
                          mclock[iE], mcount[iE])
            hidx = torch.cat((iC, iE))
            slot[mi[hidx]] = torch.cat((hs[iC], sE))
            on_device[mi[hidx]] = False
        return slot, on_device

    # -- operations ---------------------------------------------------------------------
    def _lookup(self, i: int, batch: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An accounted lookup of batch ``i`` (``HierarchicalStore._place(account=True)``)."""
        k, counts, lastpos, n = batch if batch is not None else self.b.get(i)
        if self._lookahead:
            self._mark_lookahead(i)
        out = self._resolve(k, counts, lastpos + self._clock, account=True)
        self._clock += n  # only once placed: a refused batch leaves no trace
        return out

    def _moved(self, k: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An unaccounted resolve (``_place(account=False)``)."""
        return self._resolve(k, counts, torch.full_like(k, self._clock), account=False)

    def _update(self, slot: torch.Tensor, on_dev: torch.Tensor) -> None:
        if self.updates:
            self._dev.dirty[slot[on_dev]] = True
            self._host.dirty[slot[~on_dev]] = True
            self._tally.io[IO.UPDATES] += 1
            self._tally.io[IO.UPDATED_ROWS] += slot.numel()

    def _where(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self._keys.loc.index_select(0, k)
        assert bool((g >= 0).all()), "a pinned row is not resident"
        on_dev = g < self._dev.capacity
        return torch.where(on_dev, g, g - self._host.base), on_dev

    def _pin(self, k: torch.Tensor, delta: int) -> None:
        if delta > 0:
            self._pinned_rows += int((self._pins.index_select(0, k) == 0).sum())
            self._pins[k] += delta
        else:
            self._pins[k] += delta
            self._pinned_rows -= int((self._pins.index_select(0, k) == 0).sum())

    def _mark_lookahead(self, i: int) -> None:
        """Tell the policies which resident rows batches ``i+1 .. i+window`` use."""
        soon, b = self._soon, self.b
        # the window may move back: a refused batch's plain lookup comes after later prefetches
        want = set(range(i + 1, min(i + self._window, b.n - 1) + 1))
        for j in self._soon_in - want:  # batches leaving it
            soon[b.rows(j)] -= 1
        for j in sorted(want - self._soon_in):  # batches entering it
            soon[b.rows(j)] += 1
        self._soon_in = want
        for tier in (self._dev, self._host):
            occ = tier.keys_t >= 0
            tier.policy.on_lookahead((occ & (soon.index_select(0, tier.keys_k) > 0)).nonzero().squeeze(1))

    def _run_plain(self) -> None:
        for i in range(self.b.n):
            if self.b.offsets[i + 1] > self.b.offsets[i]:
                self._update(*self._lookup(i))

    def _prefetch(self, j: int) -> _Ticket:
        """``HierarchicalStore.prefetch``: admission, an accounted placement, pins."""
        batch = self.b.get(j)
        k, _, _, n = batch
        io, U = self._tally.io, k.numel()
        if n == 0:
            return _Ticket(batch, True, True)
        io[IO.PREFETCH_REQUESTS] += 1
        dk = self._dev.keys_k[self._dev.keys_t >= 0] if self._pinned_rows else None
        pinned_dev = int((self._pins.index_select(0, dk) > 0).sum()) if dk is not None else 0
        if pinned_dev + U > self._dev.capacity or \
                self._pinned_rows + 2 * U > self._dev.capacity + self._host.capacity:  # admission
            io[IO.PREFETCH_DEGRADED] += 1
            return _Ticket(batch, False, False)
        g0 = self._keys.loc.index_select(0, k)
        was_dev = (g0 >= 0) & (g0 < self._dev.capacity)
        try:
            _, on_dev = self._lookup(j, batch)
        except CapacityError:  # nothing changed
            io[IO.PREFETCH_DEGRADED] += 1
            return _Ticket(batch, False, False)
        self._pin(k, 1)
        io[IO.PREFETCHED_ROWS] += int((on_dev & ~was_dev).sum())
        io[IO.PREFETCHED_BATCHES] += 1
        io[IO.PREFETCH_PINNED_ROWS] += U
        if not bool(on_dev.all()):
            io[IO.PREFETCH_DEGRADED] += 1
        return _Ticket(batch, True, True)

    def _revoke(self, live: dict) -> int:
        """Unpin every outstanding prefetch (``revoke_prefetches``)."""
        n = 0
        for tk in live.values():
            if tk.pinned and not tk.released:
                self._pin(tk.batch[0], -1)
                tk.pinned = False
                n += 1
        self._tally.io[IO.PREFETCH_REVOKED] += n
        return n

    def _retry(self, fn, live: dict):
        try:
            return fn()
        except CapacityError:  # later batches' pins hold the room this batch needs
            if not self._revoke(live):
                raise
            return fn()

    def _run_prefetch(self, depth: int) -> None:
        """The pipeline's order: P(0..k-1); per step L(i), P(i+k), U(i), R(i) — or, when
        batch i is not pinned at its lookup, L(i), U(i), R(i), P(i+k) (its rows could be
        moved by the next prefetch, so that prefetch waits for its update)."""
        n = self.b.n
        live: dict[int, _Ticket] = {}
        for j in range(min(depth, n)):
            live[j] = self._prefetch(j)
        for i in range(n):
            tk = live[i]
            k, counts, _, nids = tk.batch
            if nids:
                if tk.pinned:  # L: its rows are resident, used where they are pinned
                    slot, on_dev = self._where(k)
                    self._tally.io[IO.PREFETCH_HITS] += int(counts[on_dev].sum())
                elif tk.accounted:  # revoked: placed again without accounting
                    self._retry(lambda: self._moved(k, counts), live)
                else:  # refused: a plain lookup
                    self._retry(lambda: self._lookup(i, tk.batch), live)
                epoch = self._epoch
            pinned = tk.pinned
            if pinned and i + depth < n:
                live[i + depth] = self._prefetch(i + depth)
            if nids:  # U: the lookup's placement unless rows moved since (then re-placed)
                if tk.pinned or self._epoch == epoch:
                    self._update(*self._where(k))
                else:
                    self._update(*self._retry(lambda: self._moved(k, counts), live))
            if tk.pinned:  # R
                self._pin(k, -1)
            tk.released = True
            del live[i]
            if not pinned and i + depth < n:
                live[i + depth] = self._prefetch(i + depth)

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
                self._run_plain()
        finally:
            torch.set_num_threads(threads)
        self._tally.into(self.counters)
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
