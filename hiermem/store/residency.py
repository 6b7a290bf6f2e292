"""Where every row is, and moving rows there: the placement engine of a store.

:class:`Residency` owns a store's key index, its device and host tiers, the plan
workspace and the epoch (bumped whenever a row changes tier).  It places batches: the
control plane's kernels decide and commit the plan (:mod:`hiermem.core.plan`), and it
executes the plan, reading rows from and writing victims to the disk tier (LMDB) and
copying records through the data plane (:meth:`copy_plan`, on the CPU) or the staged
path (:class:`~hiermem.store.staged.StagedPath`, on CUDA).  It also reads and writes the
records of placed rows (:meth:`gather`, :meth:`parts`, :meth:`scatter`).

The :class:`~hiermem.store.HierarchicalStore` is the API over it (validation, memos,
prefetch pins, counters of lookups, checkpoints); the data plane reads placed rows
through :meth:`parts` and :meth:`gather`.  Not thread-safe on its own: the store's lock
guards every call.
"""

from __future__ import annotations

import time

from typing import Callable, Sequence

import numpy as np
import torch

from .placed import Batch, Placement
from .placing import Workspace, hash_rows, place, placed_at, placement
from ..core import plan as _plan
from ..core.index import make_index
from ..dataplane import DataPlane
from ..dataplane.staging import to_host
from ..errors import HierMemError
from ..core.policies import PolicySpec
from .staged import StagedPath
from ..observe.stats import IO, Counters
from ..tiers import DiskTier, HostTier, SlotTier
from ..tiers.slots import Rows, by_table, by_tier, table_groups
from ..types import StoreConfig, TableSpec, Tier


def tier_parts(dev, host, p: Placement, device: torch.device, settle_host=None) -> list:
    """``(tier, slots, idx, cpu_slots)`` per tier (``dev``, ``host``) holding rows of a
    placement ``p`` given by ``p.on_device`` (``slots`` on the tier's device, ``idx`` the
    batch's rows there, on ``device``); ``settle_host`` runs before host slots are named
    (the store's pending host writes).  The store's and the simulator's (all CPU)."""
    if p.on_device is None:
        return [(dev, p.slot, None, p.slot)]
    out = []
    for tier, mask in ((dev, p.on_device), (host, ~p.on_device)):
        idx = mask.nonzero().squeeze(1)
        if idx.numel():
            if tier is host and settle_host is not None:
                settle_host()
            cs = p.slot.index_select(0, idx)
            out.append((tier, cs.to(tier.device), idx.to(device), cs))
    return out


def locate(keys, dev_capacity: int, b) -> Placement | None:
    """Placement of a batch's rows where they are (None if one is in neither slot tier)."""
    g = keys.find(b.t, b.k)  # CPU: no device sync
    if bool((g < 0).any()):
        return None
    return placed_at(g, dev_capacity)


class Residency:
    """The rows of ``tables`` over a device tier, a host tier and the disk tier.

    Args:
        tables: the store's tables.
        widths: floats per record of each table (weights and optimizer state).
        config: the store's configuration (tier sizes, device).
        device: the device tier's device.
        policy: the eviction policy of both tiers.
        disk: the store's disk tier.
        counters: the store's counters (hits, misses, evictions, bytes moved).
        steps: the store's optimizer step per table (the staged path rolls back the
            step of an update whose gradients a deferred check finds not finite).
        initial: ``initial(table index, ids)``: records of rows never written.
        meta: the store's metadata, written with every write-down.
    """

    def __init__(self, tables: Sequence[TableSpec], widths: list[int], config: StoreConfig, device: torch.device,
                 policy: PolicySpec, disk: DiskTier, counters: Counters, steps: list[int],
                 initial: Callable[[int, torch.Tensor], torch.Tensor], meta: Callable[[], dict]):
        self.device = device
        self.widths = widths
        self.width = max(widths)
        self.disk = disk
        self.counters = counters
        self._initial, self._meta = initial, meta
        self.keys = make_index(config.device_rows + config.host_rows, [s.num_rows for s in tables])
        self.dev = SlotTier(Tier.DEVICE, config.device_rows, self.width, device, policy, base=0)
        self.host = HostTier(config.host_rows, widths, [s.num_rows for s in tables], policy,
                             base=config.device_rows, pin_memory=torch.cuda.is_available())
        #: the slot tiers, device first (the order rows are placed in)
        self.tiers: tuple[SlotTier, SlotTier] = (self.dev, self.host)
        self._ws = Workspace()
        #: bumped whenever any row changes tier (a placement older than it may be stale)
        self.epoch = 0
        # the data plane's side of the CUDA step (no-ops on the CPU): control arrays staged
        # in one copy, rows moved on a side stream, evictions landing in the host tier lazily
        self.staged = StagedPath(device, self.dev, self.host, self.width, counters, steps)
        self.plane: DataPlane | None = None  # set by the store with its data plane

    def read(self, t: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Records of non-resident rows (cpu): from LMDB if written, else initial."""
        kn = k.numpy()
        rec = np.zeros((kn.size, self.width), dtype=np.float32)
        found = np.zeros(kn.size, dtype=np.bool_)
        nbytes = 0
        parts = by_table(t.numpy())
        got = self.disk.read_many([(ti, kn[m], self.widths[ti]) for ti, m in parts])  # one LMDB transaction
        for (ti, m), (f, r) in zip(parts, got):
            w = self.widths[ti]
            if f.all():
                rec[m, :w], found[m] = r, True
                nbytes += m.size * w * 4
                continue
            fm = m[f]
            rec[fm, :w], found[fm] = r[f], True
            nbytes += fm.size * w * 4
            new = m[~f]
            rec[new, :w] = self._initial(ti, torch.from_numpy(kn[new])).numpy()
        self.counters.add_io(IO.BYTES_DISK_TO_HOST, nbytes)
        return torch.from_numpy(rec), torch.from_numpy(found)

    def write_down(self, rows: Rows, meta: bool = True, sync: bool = False) -> int:
        """Write rows (cpu) to LMDB in one transaction (with the metadata); without
        ``sync`` an eviction write-back, which the disk tier may combine with others or
        queue for its writer thread (:meth:`~hiermem.tiers.DiskTier.enqueue_rows`)."""
        k, rec = rows.k.numpy(), rows.rec.numpy()
        if sync:
            nbytes = self.disk.write(table_groups(rows.t.numpy(), k, rec, self.widths),
                                     meta=self._meta() if meta else None, sync=True)
        else:
            nbytes = self.disk.enqueue_rows(rows.t.numpy(), k, rec, self.widths, self._meta if meta else None)
        self.counters.add_io(IO.BYTES_HOST_TO_DISK, nbytes)
        return nbytes

    def resolve(self, b: Batch, clock: torch.Tensor, account: bool, extra: dict | None = None) -> Placement:
        """Make every row of ``b`` resident (device first, host when the device is full).

        The control plane decides (:func:`hiermem.core.plan.decide`), then the I/O that may
        fail runs (LMDB read of the rows from disk, write-back of dirty victims), so an
        error leaves the store as it was; then the plan is committed and the data plane
        copies the records it names.  ``extra``: the step's own control arrays (see
        :meth:`~hiermem.store.staged.StagedPath.extras`), staged to the device in the same copy as the plan's.
        """
        ws, res, rec_disk = place(self.keys.arrays, self.dev, self.host, self._ws, b, clock.cpu().numpy(),
                                  b.counts.cpu().numpy(), account, self.counters.table.numpy(), self)
        M = int(res[_plan.M])
        p = placement(ws, res, b.k.numel(), self.dev.capacity)
        if M == 0:
            if self.staged.active:
                p.dev = self.staged.stage(b, p, extra)
            return p
        self.epoch += 1
        t0 = time.perf_counter()
        if self.staged.active:
            self.staged.move(ws, res, rec_disk, p, b, extra)
        else:
            self.copy_plan(ws, res, rec_disk)
        self.counters.copy_seconds.observe(time.perf_counter() - t0)
        return p

    def hash_rows(self, bt: np.ndarray, bk: np.ndarray, out: np.ndarray) -> None:
        """Each row's hash (:mod:`hiermem.store.placing`'s backing): of its table and id."""
        hash_rows(bt, bk, out)

    def fetch(self, b: Batch, ws: np.ndarray, res: np.ndarray) -> torch.Tensor:
        """The plan's disk rows of ``b`` (:mod:`hiermem.store.placing`'s backing): their
        records (cpu), from LMDB if written, else initial; ``ws[FOUND]`` says which."""
        nd = int(res[_plan.N_DISK])
        pos = torch.from_numpy(ws[_plan.DISK, :nd].copy())
        rec_disk, found = self.read(b.t.cpu().index_select(0, pos), b.k.cpu().index_select(0, pos))
        ws[_plan.FOUND, :nd] = found.numpy()
        return rec_disk

    def write_victims(self, ws: np.ndarray, res: np.ndarray) -> None:
        """The plan's dirty victims to LMDB (:mod:`hiermem.store.placing`'s backing)."""
        self.write_back(ws[_plan.WB, :int(res[_plan.N_WB])])

    def write_back(self, wb: np.ndarray) -> None:
        """Write the dirty victims ``wb`` (global slots) to LMDB before their slots are reused.

        On CUDA, reading the device victims is an inherent sync: the CPU writes LMDB."""
        parts = []
        for tier, slots in by_tier(wb, self.dev, self.host):
            if slots.size:
                s = torch.from_numpy(slots)
                if tier is self.host:
                    self.staged.settle_host()
                    rec = tier.read(s, self.width)
                else:
                    rec = to_host(tier.data.index_select(0, s.to(tier.device, non_blocking=True)), "evict_to_disk")
                parts.append((tier.keys_t.index_select(0, s), tier.keys_k.index_select(0, s), rec))
        t, k, rec = (torch.cat([p[i] for p in parts]) for i in range(3))
        self.write_down(Rows(t, k, rec, torch.ones(t.numel(), dtype=torch.bool)))

    def copy_plan(self, ws: np.ndarray, res: np.ndarray, rec_disk: torch.Tensor | None) -> None:
        """The data plane of a committed plan on a CPU store: the device victims' records
        gathered, the host records coming up copied into their device slots in one pass
        (:meth:`~hiermem.dataplane.DataPlane.rows_up`), the victims written to the host
        (all three in one call where the plane can: :meth:`~hiermem.dataplane.DataPlane.swap_rows`),
        then disk records into place (:meth:`~hiermem.store.staged.StagedPath.move` is the staged form, CUDA's).  Host slots emptied
        by the plan give back their records and those filled get one of their row's width
        (:class:`~hiermem.tiers.HostTier`) before anything is written."""
        dev, host, dd = self.dev, self.host, self.device
        nu, nd = int(res[_plan.N_UP]), int(res[_plan.N_DN])
        # both ways in one pass where the plane can (a host tier of one record width: no
        # record is given back or taken, so no release or assign is needed either)
        swapped = bool(nu and nd) and self.plane.swap_rows(dev.data, host, ws[_plan.DN_SRC, :nd],
                                                           ws[_plan.DN_DST, :nd], ws[_plan.UP_SRC, :nu],
                                                           ws[_plan.UP_DST, :nu])
        down = None
        if nd and not swapped:  # the device victims first: the rows coming up take their slots
            down = dev.data.index_select(0, torch.from_numpy(ws[_plan.DN_SRC, :nd].copy()).to(dd)).cpu()
        if nu and not swapped:  # host -> device in one pass, before any host record is given back or rewritten
            up_src = ws[_plan.UP_SRC, :nu].copy()
            self.plane.rows_up(dev.data, host, up_src, ws[_plan.UP_DST, :nu].copy())
            host.release(up_src)
        if res[_plan.N_VH]:  # host victims gone to disk (their slots, unless refilled, give back their records)
            host.release(ws[_plan.VH, :int(res[_plan.N_VH])])
        if nd and not swapped:
            dn_dst = torch.from_numpy(ws[_plan.DN_DST, :nd].copy())
            host.assign(dn_dst)
            host.write(dn_dst, down)
        self.counters.add_moves(nu + int(res[_plan.NB]), nd, self.width)
        if rec_disk is None:
            return
        n, nb = rec_disk.shape[0], int(res[_plan.NB])
        dst = torch.from_numpy(ws[_plan.NEW_DST, :n].copy())
        if nb:
            dev.data.index_copy_(0, dst[:nb].to(dd), rec_disk[:nb].to(dd))
        if n > nb:
            hs = dst[nb:] - host.base
            host.assign(hs)
            host.write(hs, rec_disk[nb:])

    def gather(self, p: Placement, cols: int) -> torch.Tensor:
        """Records ``[U, cols]`` on the device of a placement's rows."""
        dev, d = self.dev, p.dev
        if p.on_device is None:
            src = dev.data if cols == dev.width else dev.data[:, :cols]
            return src.index_select(0, p.slot if d is None else d.slot)
        out = torch.empty((p.slot.numel(), cols), dtype=torch.float32, device=self.device)
        self.staged.settle_host()
        if d is None:
            di, hi = p.on_device.nonzero().squeeze(1), (~p.on_device).nonzero().squeeze(1)
            out[di] = dev.data[:, :cols].index_select(0, p.slot[di])
            out[hi] = self.host.read(p.slot[hi], cols).to(self.device)
            return out
        # the host rows: gathered on the CPU into pinned memory, one copy up
        rows = self.staged.rows_ring.take(d.host_slot.numel() * cols).view(-1, cols)
        self.host.read(d.host_slot, cols, out=rows)
        out.index_copy_(0, d.dev_idx, dev.data[:, :cols].index_select(0, d.dev_slot))
        out.index_copy_(0, d.host_idx, rows.to(self.device, non_blocking=True))
        self.staged.rows_ring.done(rows)
        return out

    def parts(self, p: Placement):
        """``(tier, slots, idx, cpu_slots)`` per tier holding rows of ``p``: ``slots`` on the
        tier's device, ``idx`` the rows of the batch in that tier, on the store's device
        (None: all of them, on the device), ``cpu_slots`` the slots on the CPU."""
        d = p.dev
        if p.on_device is None:
            return [(self.dev, p.slot if d is None else d.slot, None, p.slot)]
        out = []
        if d is not None:
            if d.dev_idx.numel():
                out.append((self.dev, d.dev_slot, d.dev_idx, d.dev_slot_cpu))
            if d.host_idx.numel():
                self.staged.settle_host()
                out.append((self.host, d.host_slot, d.host_idx, d.host_slot))
            return out
        return tier_parts(self.dev, self.host, p, self.device, self.staged.settle_host)

    def scatter(self, p: Placement, rec: torch.Tensor) -> None:
        """Write records ``[U, w]`` back to the placement's slots and mark them dirty."""
        for tier, slots, idx, cslots in self.parts(p):
            r = rec if idx is None else rec.index_select(0, idx.to(rec.device))
            tier.write(slots, r.to(tier.device))
            tier.dirty[cslots] = True

    def overwrite(self, ti: int, b: Batch, rec: torch.Tensor) -> None:
        """Set the records ``rec [U, w]`` (CPU) of the distinct rows ``b`` of table ``ti``
        where they are: resident rows in their slots (marked dirty), the others straight
        to LMDB in one transaction.  No row changes tier."""
        g = self.keys.find(b.t, b.k)
        res = g >= 0
        out = (~res).nonzero().squeeze(1)
        if out.numel():
            self.disk.write([(ti, b.k[out].cpu().numpy(), rec[out].cpu().numpy())], meta=self._meta())
        ri = res.nonzero().squeeze(1)
        if ri.numel():
            self.scatter(self._placed_at(g.index_select(0, ri)), rec.index_select(0, ri))

    def not_resident(self, b: Batch) -> list[tuple[int, np.ndarray, int]]:
        """The rows of ``b`` in neither slot tier, as ``(table, ids, width)`` groups (a
        read-ahead's LMDB reads)."""
        miss = self.keys.find(b.t, b.k) < 0
        if not bool(miss.any()):
            return []
        mt, mk = b.t[miss].cpu(), b.k[miss].cpu().numpy()
        return [(ti, mk[m], self.widths[ti]) for ti, m in by_table(mt.numpy())]

    def locate(self, b):
        """Placement of resident rows without moving anything (None if one is not resident)."""
        return locate(self.keys, self.dev.capacity, b)

    def _placed_at(self, g: torch.Tensor) -> Placement:
        """The placement of resident rows at global slots ``g`` (all ``>= 0``)."""
        return placed_at(g, self.dev.capacity)

    # -- introspection (the store's where, stats and audit) ------------------------------
    def where(self, ti: int, ids: torch.Tensor) -> torch.Tensor:
        """The :class:`Tier` (int64 codes) holding the latest value of each of table
        ``ti``'s rows ``ids``."""
        g = self.keys.find(torch.full_like(ids, ti), ids).cpu()
        out = torch.full((ids.numel(),), int(Tier.INIT), dtype=torch.int64)
        found, _ = self.disk.read(ti, ids.cpu().numpy(), self.widths[ti])
        out[torch.from_numpy(found)] = int(Tier.DISK)
        out[g >= self.host.base] = int(Tier.HOST)
        out[(g >= 0) & (g < self.dev.capacity)] = int(Tier.DEVICE)
        return out

    def dirty_rows(self) -> tuple[Rows, list]:
        """Every dirty resident row (CPU records), for a flush; and ``parts``, which
        :meth:`mark_clean` takes once they are written."""
        self.staged.settle_host()
        parts = [(tier, tier.dirty.nonzero().squeeze(1)) for tier in self.tiers]
        rows = [Rows(tier.keys_t[s].cpu(), tier.keys_k[s].cpu(), tier.read(s, self.width).cpu(), tier.dirty[s].cpu())
                for tier, s in parts]
        return Rows(*(torch.cat([getattr(r, f) for r in rows]) for f in ("t", "k", "rec", "dirty"))), parts

    @staticmethod
    def mark_clean(parts: list) -> None:
        """The rows of :meth:`dirty_rows` are in LMDB now."""
        for tier, s in parts:
            tier.dirty[s] = False

    def clear(self, wipe_disk: Callable[[], None]) -> None:
        """Forget every row: ``wipe_disk()`` empties LMDB, then the tiers and the index are
        emptied.  Raises HierMemError while a prefetch pins rows, and whatever
        ``wipe_disk`` raises; either way nothing changed (the resident rows, dirty ones
        too, are kept until LMDB is empty)."""
        for tier in self.tiers:
            if bool((tier.pins[tier.occupied()] > 0).any()):
                raise HierMemError("cannot clear a store with pinned rows (a prefetch is in flight)")
        wipe_disk()
        for tier in self.tiers:
            self.keys.remove_slots(tier.g(tier.occupied()))
            tier.clear()
        self.epoch += 1

    def occupancy(self, ntables: int) -> dict[Tier, list[int]]:
        """Rows resident per tier and table."""
        return {tier.tier: torch.bincount(tier.keys_t[tier.keys_t >= 0].cpu(), minlength=ntables).tolist()
                for tier in self.tiers}

    def audit(self) -> None:
        """Check the invariants (O(capacity)): every resident row is in exactly one slot
        of one tier, the index maps it there and holds nothing else; every host row has
        a record of its width of its own; pin counts sit on occupied slots only, and
        each tier's count of pinned slots matches its pins; the victim search's
        reservoir agrees with the keys.

        Raises:
            AssertionError: an invariant is broken.
        """
        ts, ks, gs = [], [], []
        for tier in self.tiers:
            occ = tier.occupied()
            label = tier.tier.label
            assert occ.numel() == tier.occupancy, f"{label}: free list and keys disagree"
            assert not bool(tier.dirty[tier.keys_t < 0].any()), f"{label}: dirty free slot"
            assert not bool(tier.pins[tier.keys_t < 0].any()), f"{label}: pinned free slot"
            assert bool((tier.pins >= 0).all()), f"{label}: negative pin count"
            assert tier.pinned == int((tier.pins > 0).sum()), f"{label}: pinned-slot count is off"
            tier.policy.check_reservoir(tier.keys_t >= 0)
            ts.append(tier.keys_t[occ])
            ks.append(tier.keys_k[occ])
            gs.append(tier.g(occ))
        t, k, g = torch.cat(ts), torch.cat(ks), torch.cat(gs)
        assert self.keys.size == t.numel(), "index size differs from resident rows"
        assert bool((self.keys.find(t, k) == g).all()), "index does not map a resident row to its slot"
        pairs = torch.stack((t, k), 1)
        assert torch.unique(pairs, dim=0).shape[0] == t.numel(), "a row is resident twice"
        self.host.check()
