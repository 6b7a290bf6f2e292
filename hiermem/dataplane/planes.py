"""Data planes: how a store executes the math of a placed batch on its tier tensors.

A plane does two things for :class:`~hiermem.HierarchicalStore` (which validates,
deduplicates and places the batch first, through the control plane):

* ``pool``: the pooled rows of bags of a placed batch (``nn.EmbeddingBag`` semantics);
* ``check`` then ``apply``: each distinct row's gradient (the sum over its positions
  ``j`` of ``grad[src[j]] * scale[j]``, :class:`RowGrads`) is checked for NaN/inf
  before anything changes, then the optimizer updates the rows' records in place in
  their tiers and marks them dirty.

:class:`TorchPlane` is a chain of torch ops (gather, ``embedding_bag``, the optimizer's
``apply_slots``): the reference the tests compare against, and the plane of CUDA stores.
:class:`CompiledPlane` (CPU stores) runs :mod:`hiermem.dataplane.kernels`: one parallel
pass over the bags for the lookup, one over the distinct rows for the backward with the
optimizer fused, and no per-id or per-row intermediate tensor.  It hands anything it
has no kernel for (an optimizer of the user's, a sub-batch without its sort, gradients
whose sums might overflow) to the torch plane, so every store behaves the same.

Planes keep no state of their own between calls; the store's lock serialises them.
"""

from __future__ import annotations

import math
import os
import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

import numba
import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidArgumentError, NonFiniteGradientError
from .optim import SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad
from . import kernels as K

_F32_MAX = float(np.finfo(np.float32).max)
_NO_I64 = np.zeros(0, dtype=np.int64)
_NO_F32 = np.zeros(0, dtype=np.float32)


@dataclass
class RowGrads:
    """The gradient of each distinct row of batch ``b``, not yet formed: the sum over the
    row's positions ``j`` (input order) of ``grad[src[j], :cols] * scale[j]``.

    ``src`` None: position ``j`` reads ``grad[j]``; ``scale`` None: 1.  ``summed``
    ``[U, cols]`` once a plane formed the sums (the torch plane does).
    """

    b: object
    grad: torch.Tensor
    src: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    summed: torch.Tensor | None = None
    d: object = None  # the batch's staged control arrays on the device (hiermem.store.staged.StagedPath.stage)
    defer: bool = False  # check finiteness on the device, without a host sync (see TorchPlane.check)
    #: the caller hands ``grad`` over (autograd's gradient: nobody writes it after the
    #: call), so a deferred update reads it in place instead of a copy
    owned: bool = False
    ok: torch.Tensor | None = None  # bool scalar on the device: every sum finite (a deferred check)

    def form(self) -> torch.Tensor:
        if self.summed is None:
            d = self.d
            if d is not None and "perm" in d.has and (self.src is None or "src" in d.has):
                # the sorted order, run starts and bags staged with the placement: one
                # embedding_bag on the device, no host round trip
                w = None
                if self.scale is not None:
                    w = d.scale if "scale" in d.has else \
                        self.scale.detach().to(self.grad.dtype).index_select(0, d.perm)
                idx = d.perm if self.src is None else d.src
                self.summed = F.embedding_bag(idx, self.grad.detach(), d.starts, mode="sum", per_sample_weights=w)
            else:
                self.summed = self.b.sum_rows(self.grad, self.src, self.scale)
        return self.summed


@dataclass(frozen=True)
class PlaneView:
    """What a data plane reads of its store, and nothing else: the placement engine (its
    ``parts(p)`` and ``gather(p, cols)`` of placed rows, its ``tiers``), the row optimizer,
    each table's dim, record width and optimizer step (the store's own list, so a step
    counted before a call is the one the call reads), and the store's device."""

    residency: object
    optimizer: Optimizer
    dims: np.ndarray
    widths: list
    steps: list
    device: torch.device
    #: the store's :class:`~hiermem.dataplane.deferred.DeferredApply` when its fused
    #: updates may run off the calling thread, else None
    deferred: object = None

    @property
    def device_tier(self):
        return self.residency.tiers[0]

    @property
    def host_tier(self):
        return self.residency.tiers[1]


def _refuse(what: str) -> None:
    raise NonFiniteGradientError(f"{what} contain NaN or inf (or their per-row sums overflow); nothing changed")


class DataPlane(ABC):
    """The data plane of a store (see the module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def pool(self, view, p, inverse: torch.Tensor, offsets: torch.Tensor, n: int, cols: int, mode: str,
             psw: torch.Tensor | None, samples: int | None = None) -> torch.Tensor:
        """Pooled rows ``[len(offsets), cols]`` of bags of positions whose distinct row is
        ``inverse [n]``, placed at ``p``; ``psw``: per-sample weights (sum mode).
        ``samples``: the bags are tables of ``samples`` bags each (table-major), and the
        result sample-major, ``[samples, len(offsets) / samples * cols]``."""

    @abstractmethod
    def check(self, rg: RowGrads, what: str) -> None:
        """Raise :class:`NonFiniteGradientError` (nothing changed) when a row's gradient
        is not finite."""

    @abstractmethod
    def apply(self, view, rg: RowGrads, p, present: list[int]) -> None:
        """One optimizer step of every distinct row of ``rg.b`` (placed at ``p``) with its
        gradient, in place; ``present``: the batch's tables (their steps already counted)."""

    def apply_row_stat(self, view, p, ti: int, g: torch.Tensor, st: torch.Tensor) -> None:
        """One optimizer step of table ``ti``'s distinct rows (placed at ``p``) with
        gradients ``g [U, dim]`` and a per-row statistic ``st [U]`` reduced outside (a
        column shard's, see :meth:`~hiermem.view.HierarchicalStore.update_with_row_stat`);
        both in the placement's row order, on the store's device (the step already counted)."""
        opt, dim, w, step = view.optimizer, int(view.dims[ti]), view.widths[ti], view.steps[ti]
        for tier, slots, idx, cslots in view.residency.parts(p):
            gi = g if idx is None else g.index_select(0, idx).to(tier.device)
            si = st if idx is None else st.index_select(0, idx).to(tier.device)
            tier.update(slots, w, lambda data, rows, gi=gi, si=si:
                        opt.apply_slots_with_row_stat(data, rows, gi, dim, w, step, si))
            tier.dirty[cslots] = True

    def rows_up(self, dev: torch.Tensor, host, src: np.ndarray, dst: np.ndarray) -> None:
        """A CPU placement's host -> device copy: ``dev[dst[i]]`` = the record of host
        slot ``src[i]`` (int64 arrays), zeros past its width.  The caller has read what
        ``dst`` overwrites (the device victims going down)."""
        rec = host.read(torch.from_numpy(src), dev.shape[1]).to(dev.device, non_blocking=True)
        dev.index_copy_(0, torch.from_numpy(dst).to(dev.device), rec)

    def swap_rows(self, dev: torch.Tensor, host, dn_src: np.ndarray, dn_dst: np.ndarray, up_src: np.ndarray,
                  up_dst: np.ndarray) -> bool:
        """A CPU placement's device victims down (``dev[dn_src[i]]`` to host slot
        ``dn_dst[i]``) and host rows up (host slot ``up_src[i]`` to ``dev[up_dst[i]]``),
        in one call; int64 arrays.  False (nothing copied) where the plane has no such
        form for these tiers: the caller then gathers, copies up and writes down itself."""
        return False


class TorchPlane(DataPlane):
    """Torch ops: the reference, and the plane of CUDA stores (every op on the device)."""

    name = "torch"

    def pool(self, view, p, inverse, offsets, n, cols, mode, psw, samples=None):
        out = self._pool(view, p, inverse, offsets, n, cols, mode, psw)
        if samples is None:
            return out
        return out.view(-1, samples, cols).transpose(0, 1).reshape(samples, -1)

    def _pool(self, view, p, inverse, offsets, n, cols, mode, psw):
        dev, d = view.device_tier, p.dev
        if d is not None:  # staged (CUDA): the device copies of the control arrays
            inverse, offsets = d.inverse, d.offsets
        if p.on_device is None:
            if cols == dev.width:
                src, idx = dev.data, (p.slot.index_select(0, inverse) if d is None else d.ids_slot)
            else:  # a column slice is not contiguous (embedding_bag would copy the whole
                # tier): gather the batch's distinct rows, then pool from them
                src, idx = dev.data.index_select(0, p.slot if d is None else d.slot)[:, :cols], inverse
        else:
            src, idx = view.residency.gather(p, cols), inverse
        return F.embedding_bag(idx, src, offsets, mode=mode, per_sample_weights=psw)

    def check(self, rg, what):
        g = rg.form()
        if rg.defer:
            # no host sync: apply() leaves every row as it was unless this flag is set,
            # and the store reads it (raising then) at its next update or flush
            rg.ok = torch.isfinite(g).all()
            return
        # NaN/inf in any gradient survives the per-row sums (inf-inf is NaN), so one
        # reduction over the summed rows checks them all
        if not bool(torch.isfinite(g.sum())) and not bool(torch.isfinite(g).all()):
            _refuse(what)

    def apply(self, view, rg, p, present):
        b, g, opt = rg.b, rg.form(), view.optimizer
        # one optimizer call per group of tables with the same dim, width and step count
        groups: dict[tuple, list[int]] = defaultdict(list)
        for ti in present:
            groups[(int(view.dims[ti]), view.widths[ti], view.steps[ti])].append(ti)
        t = b.t.numpy()
        for (dim, width, step), tis in groups.items():
            rows = None if len(tis) == len(present) else _rows_of(t, tis)
            for tier, slots, idx, cslots in view.residency.parts(p):
                gi = g if idx is None else g.index_select(0, idx)
                if rows is not None:
                    part = None if idx is None else np.flatnonzero(p.on_device.numpy() == (tier is view.device_tier))
                    sel = _select(rows, part, g.device)
                    if sel is None:
                        continue
                    sel_dev, sel_cpu = sel
                    gi, cslots = gi.index_select(0, sel_dev), cslots.index_select(0, sel_cpu)
                    slots = cslots if slots.device.type == "cpu" else slots.index_select(0, sel_dev)
                gi = gi[:, :dim]
                if tier.device.type != gi.device.type:  # rows on the host tier: updated by the CPU
                    from .staging import to_host

                    gi = to_host(gi, "host_tier_update")
                ok = None if rg.ok is None else rg.ok.to(tier.device)
                tier.update(slots, width, lambda data, rows, gi=gi, dim=dim, width=width, step=step, ok=ok:
                            _apply_masked(opt, data, rows, gi, dim, width, step, ok))
                tier.dirty[cslots] = True


def _apply_masked(opt, data, slots, grad, dim, width, step, ok) -> None:
    """``opt.apply_slots``; with ``ok`` (a bool scalar tensor) the rows keep their old
    records unless it is set (the deferred finiteness check: no host sync)."""
    if ok is None:
        opt.apply_slots(data, slots, grad, dim, width, step)
        return
    view = data if width == data.shape[1] else data[:, :width]
    old = view.index_select(0, slots)
    rec = old.clone()
    opt.apply(rec, grad, dim, step)
    view.index_copy_(0, slots, torch.where(ok, rec, old))


def _rows_of(t: np.ndarray, tis: list[int]) -> np.ndarray:
    """Positions (ascending) of the distinct rows of tables ``tis`` in table codes ``t``."""
    return np.flatnonzero(np.isin(t, np.asarray(tis, dtype=t.dtype)))


def _select(rows: np.ndarray, part: np.ndarray | None, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the batch's rows ``rows`` (CPU positions) sit within a part whose rows are
    ``part`` (CPU positions; None: all): ``(on the device, on the CPU)``, None when
    there are none.  On the device without a host copy when they are one run (a
    table's rows are one run: a batch is sorted by table)."""
    sel = rows if part is None else np.flatnonzero(np.isin(part, rows))
    if sel.size == 0:
        return None
    sel_cpu = torch.from_numpy(sel)
    cuts = np.flatnonzero(np.diff(sel) != 1) + 1
    if cuts.size < 16:  # a few runs (a table's rows are one): aranges on the device, no copy
        bounds = zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [sel.size])).tolist())
        parts = [torch.arange(int(sel[a]), int(sel[b - 1]) + 1, device=device) for a, b in bounds]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), sel_cpu
    return sel_cpu.to(device, non_blocking=True), sel_cpu


def _np(x: torch.Tensor | None, empty: np.ndarray) -> np.ndarray:
    """A contiguous numpy view of a CPU tensor (``empty`` for None).  No torch op where
    none is needed: each lets a background thread take the GIL from the training thread
    (measured: 10-60 us each while a prefetch thread runs Python)."""
    if x is None:
        return empty
    if x.requires_grad:
        x = x.detach()
    return x.numpy() if x.is_contiguous() else x.contiguous().numpy()


#: Below this many floats of work a kernel runs on the calling thread alone (as torch's
#: ``parallel_for`` below its grain size): waking a pool costs more than it saves, and on a
#: loaded host a parallel region waits for its slowest thread's next time slice.
PARALLEL_WORK = 1 << 18


_numba_started = False


def start_numba_threads() -> None:
    """Start numba's thread pool (once per process), keeping torch's intra-op count.

    numba starts its pool at the first parallel kernel or thread-count call, and its
    OpenMP layer (on torch's own libgomp) then sets the calling thread's OpenMP thread
    count to ``NUMBA_NUM_THREADS`` (the core count), which torch reads as its intra-op
    count: a process that asked torch for 1 thread runs its ops on 2 from then on, and
    the second thread, spin-waiting between parallel regions, takes the core that the
    prefetch thread needs (measured in ``scripts/bench_pipeline.py``: host-backed 0.80x
    of plain tables when the first parallel kernel ran on the training thread, 1.2x when
    it ran on a background thread)."""
    global _numba_started
    if _numba_started:
        return
    keep = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool
    if torch.get_num_threads() != keep:
        torch.set_num_threads(keep)
    _numba_started = True


#: the numba thread count each thread last set here: numba's ``get_num_threads`` takes two
#: locks and a foreign call each time (2-6 us inside a run, three times a step on the
#: training thread), while the count is the thread's own and changes only when set
_set_count = threading.local()


def _threads(work: int) -> int:
    """Set numba's thread count (per calling thread) for ``work`` floats: torch's intra-op
    count, or 1 for small work; returns it.  (A count set on this thread by anyone else
    with ``numba.set_num_threads`` stands until this one changes.)"""
    if not _numba_started:
        start_numba_threads()
    n = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS) if work >= PARALLEL_WORK else 1
    if getattr(_set_count, "n", None) != n:
        numba.set_num_threads(n)
        _set_count.n = n
    return n


def _tasks(starts: np.ndarray, n: int, threads: int) -> np.ndarray:
    """Bounds of the backward's parallel tasks over distinct rows (``starts``: where each
    row's ids start in the sorted order, of ``n``): 8 per thread, of about equal numbers of
    ids, so a thread with a hot row (thousands of ids) gets fewer rows besides."""
    if threads == 1:
        return np.array([0, starts.size], dtype=np.int64)
    tasks = min(max(1, starts.size), 8 * threads)
    return np.searchsorted(starts, np.linspace(0, n, tasks + 1).astype(np.int64)).astype(np.int64)


def _sgd(o, steps):
    return (o.lr,), None


def _adagrad(o, steps):
    return (o.lr, o.eps), None


def _adam(o, steps):
    coef = [o.lr * math.sqrt(1 - o.beta2 ** s) / (1 - o.beta1 ** s) if s > 0 else 0.0 for s in steps]
    return (o.beta1, o.beta2, o.eps), np.asarray(coef, dtype=np.float32)


# optimizer class (exactly: a subclass may change the math) -> (its kernel, a function of
# the optimizer and the tables' step counts giving its hyper-parameters and per-table
# coefficients)
FUSED = {SGD: (K.sgd, _sgd), Adagrad: (K.adagrad, _adagrad), RowWiseAdagrad: (K.rowwise_adagrad, _adagrad),
         Adam: (K.adam, _adam)}


class CompiledPlane(DataPlane):
    """Compiled CPU kernels (:mod:`hiermem.dataplane.kernels`), torch for the rest."""

    name = "compiled"

    def __init__(self) -> None:
        self._torch = TorchPlane()

    @staticmethod
    def _gslots(view, p) -> np.ndarray:
        if p.on_device is None:
            return _np(p.slot, _NO_I64)
        return _np(torch.where(p.on_device, p.slot, p.slot + view.device_tier.capacity), _NO_I64)

    def rows_up(self, dev, host, src, dst):
        """One pass, no intermediate (:func:`~hiermem.dataplane.kernels.rows_up`)."""
        rows, hoff = host.kernel_arrays()
        W = dev.shape[1]
        mixed = hoff is not None
        if dev.device.type != "cpu" or not src.size or (not mixed and rows.shape[1] != W):
            return self._torch.rows_up(dev, host, src, dst)
        _threads(src.size * W)
        K.rows_up(dev.numpy(), rows, hoff, host.hcls if mixed else None, host.cw if mixed else _NO_I64,
                  np.ascontiguousarray(src, dtype=np.int64), np.ascontiguousarray(dst, dtype=np.int64), K.AHEAD)

    def swap_rows(self, dev, host, dn_src, dn_dst, up_src, up_dst):
        """:func:`~hiermem.dataplane.kernels.swap_rows` where the host tier's records are
        all of the device tier's width (the common case: one optimizer, one dim)."""
        rows, hoff = host.kernel_arrays()
        W = dev.shape[1]
        if dev.device.type != "cpu" or hoff is not None or rows.shape[1] != W or not dn_src.size or not up_src.size:
            return False
        _threads((dn_src.size + up_src.size) * W)
        i64 = np.ascontiguousarray
        K.swap_rows(dev.numpy(), rows, i64(dn_src, dtype=np.int64), i64(dn_dst, dtype=np.int64),
                    i64(up_src, dtype=np.int64), i64(up_dst, dtype=np.int64),
                    np.empty((dn_src.size, W), dtype=np.float32), K.AHEAD)
        return True

    def pool(self, view, p, inverse, offsets, n, cols, mode, psw, samples=None):
        if view.device.type != "cpu":
            return self._torch.pool(view, p, inverse, offsets, n, cols, mode, psw, samples)
        nb = offsets.numel()
        out = np.empty((nb, cols), dtype=np.float32)  # (a torch.empty would be one more op)
        dev, host = view.device_tier, view.host_tier
        _threads(n * cols)
        K.pool(dev.data.numpy(), *host.kernel_arrays(), dev.capacity, self._gslots(view, p), _np(inverse, _NO_I64),
               _np(offsets, _NO_I64), n, _np(psw, _NO_F32), mode == "mean", out, nb if samples is None else samples)
        if samples is not None:
            out = out.reshape(samples, nb // samples * cols)  # rows written sample-major: a view
        return torch.from_numpy(out)

    def check(self, rg, what):
        b = rg.b
        if b.perm is None or rg.grad.device.type != "cpu":
            return self._torch.check(rg, what)
        grad = rg.grad
        rows = grad.shape[0]
        ok, gmax = K.max_abs(grad.numpy(), rows, grad.shape[1], _threads(grad.numel()))
        smax = 1.0
        if rg.scale is not None and rg.scale.numel():
            sok, smax = K.max_abs(_np(rg.scale, _NO_F32).reshape(-1, 1), rg.scale.numel(), 1, _threads(rg.scale.numel()))
            ok = ok and sok
        # every partial sum of a row is at most (its count) x gmax x smax (x (1 + 2**-23)
        # per add): far from float32's max, no sum can overflow.  Otherwise (NaN/inf
        # somewhere, perhaps in a row no id reads, or a loose bound) the sums themselves
        # decide, formed by torch (and then applied by torch)
        # (the count's bound, the batch's positions, spares a reduction over the counts)
        if not ok or (gmax * smax * b.n * 2.0 >= _F32_MAX and gmax * smax * int(b.counts.max()) * 2.0 >= _F32_MAX):
            self._torch.check(rg, what)

    def apply(self, view, rg, p, present):
        fused = FUSED.get(type(view.optimizer))
        if rg.summed is not None or fused is None or view.device.type != "cpu":
            return self._torch.apply(view, rg, p, present)
        kernel, params = fused
        hp, coef = params(view.optimizer, view.steps)
        b, dev, host = rg.b, view.device_tier, view.host_tier
        dims, starts = view.dims, _np(b.starts, _NO_I64)
        nt = _threads(b.n * rg.grad.shape[1] + b.k.numel() * dev.width)
        rows, hoff = host.kernel_arrays()
        args = (dev.data.numpy(), rows, hoff, dev.capacity, dev.state[2], host.state[2], self._gslots(view, p),
                _np(b.t, _NO_I64), dims, _np(b.perm, _NO_I64), starts, _np(b.counts, _NO_I64),
                _tasks(starts, b.n, nt), _np(rg.src, _NO_I64), _np(rg.grad, _NO_F32), _np(rg.scale, _NO_F32),
                _NO_F32 if coef is None else coef)
        d = view.deferred
        if d is not None and nt == 1 and d.accepts(kernel, rows, hoff) and \
                d.submit(kernel, *args[:2], *args[3:], hp, copy_grad=not rg.owned):
            return  # on the store's apply worker; the store's lock waits for it (hiermem.dataplane.deferred)
        kernel(*args, *hp)


PLANES: dict[str, type[DataPlane]] = {c.name: c for c in (TorchPlane, CompiledPlane)}


def plane_named(name: str) -> DataPlane:
    """A plane by name (``"compiled"`` or ``"torch"``)."""
    cls = PLANES.get(name)
    if cls is None:
        raise InvalidArgumentError(f"unknown data plane {name!r}; planes are {sorted(PLANES)}")
    return cls()


def default_plane(device: torch.device) -> DataPlane:
    """The compiled kernels on CPU, torch ops elsewhere (CUDA); ``HIERMEM_DATA_PLANE=torch``
    (or ``compiled``) overrides it, e.g. to compare bit for bit with a torch-op reference
    (the compiled plane equals the torch plane to ~1 ulp, not bitwise: see
    docs/dataplane.md)."""
    name = os.environ.get("HIERMEM_DATA_PLANE", "").strip().lower()
    if name:
        return plane_named(name)
    return CompiledPlane() if device.type == "cpu" else TorchPlane()
