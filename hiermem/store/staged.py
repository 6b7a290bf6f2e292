"""The CUDA step path of a store: its data plane's side of a batch (see
docs/dataplane.md, "CUDA").  :class:`StagedPath` is a part of each
:class:`~hiermem.store.HierarchicalStore`, with the state it needs of its own.

After the control plane placed a batch on the CPU, the data plane needs a few index
arrays on the device: :meth:`StagedPath.stage` sends them in one copy (with the step's
own arrays, so the fused update of the same batch sends none); :meth:`~StagedPath.move`
moves the plan's rows on the store's side stream from and to pinned memory;
:meth:`~StagedPath.settle_host` lands evicted rows in the host tier when the CPU next
needs it; :meth:`~StagedPath.row_grads`, :meth:`~StagedPath.defer` and
:meth:`~StagedPath.check_deferred` form each row's gradient on the device and check it
for NaN/inf there, without a host sync.  On a CPU store the same code runs under the
torch plane (the streams are no-ops), so CPU tests exercise it.

Not thread-safe on its own: the store's lock guards every method.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core import plan as _plan
from ..dataplane import RowGrads
from ..dataplane.staging import CopyStream, PinnedRing, Stager, inherent_wait
from ..errors import NonFiniteGradientError

if TYPE_CHECKING:
    from .placed import Batch, Placement
    from ..observe.stats import Counters
    from ..tiers import HostTier, SlotTier


class StagedPath:
    """The staged data-plane path of one store.

    Args:
        device: the store's device.
        dev, host: its device and host tiers.
        width: floats per record.
        counters: the store's counters (bytes moved).
        steps: the store's optimizer step per table (rolled back when a deferred check
            finds an update's gradients were not finite); the same list, updated in place.
    """

    def __init__(self, device: torch.device, dev: SlotTier, host: HostTier, width: int, counters: Counters,
                 steps: list[int]):
        self.device, self.dev, self.host, self.width = device, dev, host, width
        self.counters, self.steps = counters, steps
        #: whether the data plane reads staged control arrays (:meth:`stage`): on CUDA, and
        #: on the CPU under the torch plane (so CPU tests run the same code); the store
        #: sets it with its data plane
        self.active = device.type == "cuda"
        self.stager = Stager(device)  # control arrays to the device in one copy
        self.copies = CopyStream(device)  # rows moved on a side stream
        self.rows_ring = PinnedRing(pinned=device.type == "cuda", dtype=torch.float32)
        self.pending_down: list[tuple] = []  # (event, pinned rows, host slots) not yet in the host tier
        self.nonfinite: list[tuple] = []  # (event, pinned flag, tables, what) of updates checked on the device
        #: check gradients for NaN/inf on the device, masking the update and raising at the
        #: next update or flush, instead of a host sync per update (CUDA; see docs/dataplane.md)
        self.defer_nonfinite = device.type == "cuda"

    def move(self, ws: np.ndarray, res: np.ndarray, rec_disk: torch.Tensor | None, p: Placement, b: Batch,
                     extra: dict | None) -> None:
        """The data plane of a committed plan, staged (CUDA; the torch plane on the CPU).

        The plan's device-side slot arrays go with the placement's and the step's in one
        copy (:meth:`stage`).  Rows coming up (from the host tier, and from disk for the
        device) are gathered on the CPU into one pinned buffer; on the side stream, after
        the compute stream's queued work: one copy up, the evicted device rows gathered
        and copied down into pinned memory, the rows up written into their slots; the
        compute stream then waits for the side stream (on the device, not the host).
        The rows going down land in the host tier (in records it assigns them now) only when
        the CPU next needs it (:meth:`settle_host`), so no step waits for its own evictions.
        """
        dev, host, dd = self.dev, self.host, self.device
        nu, nd, nb = int(res[_plan.N_UP]), int(res[_plan.N_DN]), int(res[_plan.NB])
        n = 0 if rec_disk is None else rec_disk.shape[0]
        new_dst = ws[_plan.NEW_DST, :n].copy()
        moves = {"up_dst": ws[_plan.UP_DST, :nu].copy(), "dn_src": ws[_plan.DN_SRC, :nd].copy(),
                 "new_dst": new_dst[:nb]}
        p.dev = d = self.stage(b, p, extra, moves)
        self.settle_host()  # the CPU reads and writes the host tier below
        up_rows = nu + nb
        buf = None
        if up_rows:
            buf = self.rows_ring.take(up_rows * self.width).view(up_rows, self.width)
            if nu:
                up_src = torch.from_numpy(ws[_plan.UP_SRC, :nu].copy())
                host.read(up_src, self.width, out=buf[:nu])
                host.release(up_src)
            if nb:
                buf[nu:] = rec_disk[:nb]
        with self.copies as cs:
            cs.keep(d.buffer)
            up = None
            if buf is not None:
                up = buf.to(dd, non_blocking=True)
                self.rows_ring.done(buf)
            if res[_plan.N_VH]:  # host victims gone to disk give back their records (unless refilled)
                host.release(ws[_plan.VH, :int(res[_plan.N_VH])])
            if nd:
                dn_dst = torch.from_numpy(ws[_plan.DN_DST, :nd].copy())
                host.assign(dn_dst)  # records now; the rows land in them at _settle_host
                down = dev.data.index_select(0, d.dn_src)
                pinned = torch.empty(down.shape, dtype=torch.float32, pin_memory=dd.type == "cuda")
                pinned.copy_(down, non_blocking=True)
                self.pending_down.append((cs.event(), pinned, dn_dst))
            if nu:
                dev.data.index_copy_(0, d.up_dst, up[:nu])
            if nb:
                dev.data.index_copy_(0, d.new_dst, up[nu:])
        if n > nb:
            hs = torch.from_numpy(new_dst[nb:]) - host.base
            host.assign(hs)
            host.write(hs, rec_disk[nb:])
        self.counters.add_moves(nu + nb, nd, self.width)

    def settle_host(self) -> None:
        """Land the rows copied down by earlier plans in the host tier (in the records
        their plan assigned them); before the CPU reads or writes it.  Waits for those
        copies (normally long done: they were queued a step or more ago; counted in
        ``hiermem.dataplane.staging.WAITS``)."""
        while self.pending_down:
            ev, rows, dst = self.pending_down.pop(0)
            inherent_wait(ev, "host_tier_read")
            self.host.write(dst, rows)

    def extras(self, b: Batch, offsets: torch.Tensor | None = None, bag: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> dict | None:
        """The step's own control arrays for :meth:`stage` (None when not staging): the
        bags' offsets, and in the batch's sorted order the ids' bags and scales (CPU)."""
        if not self.active:
            return None
        ex: dict = {}
        if offsets is not None:
            ex["offsets"] = offsets.numpy()
        if b.perm is not None:
            perm = b.perm.numpy()
            ex["perm"], ex["starts"] = perm, b.starts.numpy()
            if bag is not None:
                ex["src"] = bag.numpy()[perm]
            if scale is not None and scale.device.type == "cpu":
                ex["scale"] = scale.numpy()[perm]
        return ex

    def stage(self, b: Batch, p: Placement | None = None, extra: dict | None = None,
               moves: dict | None = None) -> SimpleNamespace:
        """The control arrays of a batch (and its placement ``p``, the step's ``extra``, a
        plan's ``moves``) on the store's device, in one host-to-device copy.

        Fields: ``inverse [n]``; with ``p``: ``slot [U]``, and ``ids_slot [n]`` (each id's
        device slot) when every row is on the device, else ``dev_idx``/``dev_slot`` and
        ``host_idx`` (the batch's rows in each tier, and the device ones' slots) with
        ``host_slot`` (CPU); the keys of ``extra`` and ``moves``; ``buffer``: the device
        copy they all view.
        """
        arrays: dict = {"inverse": b.inverse.numpy()}
        cpu: dict = {}
        if p is not None:
            slot = p.slot.numpy()
            arrays["slot"] = slot
            if p.on_device is None:
                arrays["ids_slot"] = slot[arrays["inverse"]]
            else:
                od = p.on_device.numpy()
                di, hi = np.flatnonzero(od), np.flatnonzero(~od)
                arrays.update(dev_idx=di, dev_slot=slot[di], host_idx=hi)
                cpu.update(host_slot=torch.from_numpy(slot[hi]), dev_slot_cpu=torch.from_numpy(slot[di]))
        arrays.update(extra or {})
        arrays.update(moves or {})
        names = list(arrays)
        out = self.stager.send([np.ascontiguousarray(arrays[k]) for k in names], pack=True)
        d = SimpleNamespace(**dict(zip(names, out)), **cpu)
        d.buffer = next((v for v in out if v is not None and v.numel()), None)
        d.has = frozenset(names)
        return d

    def staged(self, b: Batch, p: Placement, extra: dict | None) -> SimpleNamespace | None:
        """``p.dev`` holding ``extra``'s arrays too, staged now if it does not already."""
        if not self.active:
            return None
        if p.dev is None or not set(extra or ()) <= p.dev.has:
            p.dev = self.stage(b, p, extra)
        return p.dev

    def row_grads(self, b: Batch, p: Placement | None, grad: torch.Tensor, src: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None, reuse_bags: bool = True) -> RowGrads:
        """The per-row gradients of batch ``b`` (placed at ``p``, or None), with the batch's
        control arrays staged on the device (the placement's when they are there, else
        staged now: one copy) when the store stages.  ``reuse_bags``: ``src``/``scale``
        are the ones staged with ``p`` (the same call's lookup), if any were."""
        if grad.dtype != torch.float32:
            grad = grad.to(torch.float32)
        if not grad.is_contiguous():
            grad = grad.contiguous()
        d = None
        if self.active and b.perm is not None:
            d = p.dev if p is not None else None
            want = {"perm", "starts"}
            if src is not None:
                want.add("src")
            if scale is not None and scale.device.type == "cpu":
                want.add("scale")
            if d is None or not want <= d.has or (src is not None and not reuse_bags):
                d = self.stage(b, None, self.extras(b, None, src, scale))
        return RowGrads(b, grad, src, scale, d=d, defer=d is not None and self.defer_nonfinite)

    def defer(self, rg: RowGrads, tables: list[int], what: str) -> None:
        """Remember the device-side finiteness flag of an update just applied (masked):
        copied to pinned memory without waiting, read by :meth:`check_deferred`."""
        if rg.ok is None:
            return
        flag = torch.empty((), dtype=torch.bool, pin_memory=rg.ok.is_cuda)
        flag.copy_(rg.ok, non_blocking=True)
        self.nonfinite.append((self.copies.event(), flag, list(tables), what))

    def check_deferred(self, raise_: bool = True) -> None:
        """Read the finiteness flags of earlier updates (waiting for them if the device has
        not got there yet: the previous update's work, normally done).  An update whose
        gradients were not finite changed no row (it was masked on the device); its
        tables' step counts are rolled back here and :class:`NonFiniteGradientError` is
        raised (before the caller changes anything)."""
        bad = []
        while self.nonfinite:
            ev, flag, tables, what = self.nonfinite.pop(0)
            inherent_wait(ev, "nonfinite_flag")
            if not bool(flag):
                for ti in tables:
                    self.steps[ti] -= 1
                bad.append(what)
        if bad and raise_:
            raise NonFiniteGradientError(
                f"{bad[0]} of an earlier update contained NaN or inf (or their per-row sums overflow): that "
                f"update changed no row and its step is undone; on {self.device} the check runs on the device "
                "and is reported at the next update or flush (this call changed nothing)")
