"""The host tier: slots as the control plane counts them, records at each table's width.

The control plane (:mod:`hiermem.core`) counts host capacity in slots and picks victims
across all tables; this tier keeps exactly those slots (:class:`SlotTier`'s keys, dirty
bits, pins, free stack and policy) and only changes where a slot's record bytes live.

*Uniform* (every table has the same record width, the common case): one float32
``[capacity, width]`` tensor, slot ``s``'s record at row ``s``, as every other tier.

*Mixed* widths: one *class* per distinct record width; the records of a class are rows
of that class's pool, a region ``[ccap[c], cw[c]]`` of one flat float32 *arena* (pinned
on CUDA hosts).  A host slot points at its record by ``hoff[s]`` (the record's first
float in the arena) and ``hcls[s]`` (its class; -1: no record).  A row gets a record of
its table's class when it enters the tier (:meth:`HostTier.assign`) and returns it to
its class's free stack when it leaves (:meth:`HostTier.release`); a pool grows by
doubling (reallocating the arena, records copied) from nothing up to ``min(capacity,
rows of the class's tables)`` records, so memory follows the mix of rows actually held, not
capacity x the widest record.  The free stacks live in one int64 array, class ``c``'s
at ``fstack[fbase[c]:fbase[c] + ccap[c]]``.

Both layouts answer the same small API: :meth:`read` / :meth:`write` records of slots
(compiled loops over arrays, no per-row Python), :meth:`update` (read, change, write
back: the torch optimizers), and :meth:`kernel_arrays` for the compiled data plane,
which addresses record ``s`` as row ``hoff[s]`` of a float-stride view of the storage
(``view[o, c] == flat[o + c]``), or (one width) as row ``s`` of the tier's array.  Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from ..core.layout import RECORD
from ..core.policies import PolicySpec
from ..types import Tier
from .slots import SlotTier

#: records a class's pool takes when its first row comes (it doubles from there, up
#: to its bound); a class none of whose rows is on the host takes nothing
FIRST_RECORDS = 256


def _jit(fn):
    return numba.njit(cache=True, nogil=True)(fn)


@_jit
def assign_records(slots, keys_t, tcls, hcls, hoff, cw, cbase, ccap, cused, cnfree, fbase, fstack, start):
    """Give each host slot of ``slots[start:]`` (int64, occupied) a record of its row's
    class ``tcls[keys_t[s]]``; a slot holding one of another class returns it first.

    Returns ``(i, c)``: ``(slots.size, -1)`` when done, else the first slot ``slots[i]``
    left without a record because class ``c``'s pool is full (grow it, call again from
    ``i``).  ``hcls``: int64 ``[H]``; ``hoff``: int64 ``[H]``; ``cw, cbase, ccap, cused,
    cnfree, fbase``: int64 ``[K]`` per class (width, first float, records, records ever
    handed out, free records, start of its free stack); ``fstack``: int64.
    """
    for i in range(start, slots.size):
        s = slots[i]
        c = tcls[keys_t[s]]
        old = hcls[s]
        if old == c:
            continue
        if old >= 0:
            fstack[fbase[old] + cnfree[old]] = (hoff[s] - cbase[old]) // cw[old]
            cnfree[old] += 1
            hcls[s] = -1
        if cnfree[c] > 0:
            cnfree[c] -= 1
            r = fstack[fbase[c] + cnfree[c]]
        elif cused[c] < ccap[c]:
            r = cused[c]
            cused[c] += 1
        else:
            return i, c
        hcls[s] = c
        hoff[s] = cbase[c] + r * cw[c]
    return slots.size, -1


@_jit
def release_records(slots, keys_t, hcls, hoff, cw, cbase, cnfree, fbase, fstack):
    """Return the records of the slots of ``slots`` that are now empty (``keys_t < 0``)
    to their classes' free stacks (arrays as :func:`assign_records`)."""
    for i in range(slots.size):
        s = slots[i]
        c = hcls[s]
        if keys_t[s] < 0 and c >= 0:
            fstack[fbase[c] + cnfree[c]] = (hoff[s] - cbase[c]) // cw[c]
            cnfree[c] += 1
            hcls[s] = -1
            hoff[s] = 0


@_jit
def gather_records(flat, hoff, hcls, cw, slots, out):
    """``out[i, :w] = record(slots[i])[:w]``, zeros after (``w`` = min(its width, cols));
    ``flat``: float32 arena; ``out``: float32 ``[n, cols]``."""
    cols = out.shape[1]
    for i in range(slots.size):
        s = slots[i]
        c = hcls[s]
        w = min(cw[c], cols) if c >= 0 else 0
        o = hoff[s]
        for j in range(w):
            out[i, j] = flat[o + j]
        for j in range(w, cols):
            out[i, j] = np.float32(0.0)


@_jit
def scatter_records(flat, hoff, hcls, cw, slots, rec):
    """``record(slots[i])[:w] = rec[i, :w]`` (``w`` = min(its width, ``rec``'s columns))."""
    cols = rec.shape[1]
    for i in range(slots.size):
        s = slots[i]
        c = hcls[s]
        if c < 0:
            continue
        w = min(cw[c], cols)
        o = hoff[s]
        for j in range(w):
            flat[o + j] = rec[i, j]


def _rows_view(flat: np.ndarray, width: int) -> np.ndarray:
    """``[len(flat) - width + 1, width]`` float32 with ``view[o, c] == flat[o + c]``."""
    n = max(1, flat.size - width + 1)
    if flat.size < width:
        flat = np.zeros(width, dtype=np.float32)
    return as_strided(flat, (n, width), (4, 4))


def _i64(slots) -> np.ndarray:
    if isinstance(slots, torch.Tensor):
        return slots.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.ascontiguousarray(slots, dtype=np.int64)


class HostTier(SlotTier):
    """The host tier: ``capacity`` slots on the CPU, each row's record at its table's
    width (``widths[t]`` floats); ``bounds[t]``: rows of table ``t`` (None: unbounded)."""

    def __init__(self, capacity: int, widths, bounds, policy: PolicySpec, base: int, pin_memory: bool = False):
        widths = np.asarray(widths, dtype=np.int64)
        self._pin = pin_memory
        self.cw, tcls = np.unique(widths, return_inverse=True)
        self.uniform = self.cw.size <= 1
        W = int(widths.max())
        super().__init__(Tier.HOST, capacity, W if self.uniform else 0, torch.device("cpu"), policy, base,
                         pin_memory=pin_memory)
        self.width = W
        C, K = self.capacity, self.cw.size
        if self.uniform:
            self.hcls = self.hoff = np.zeros(0, dtype=np.int64)  # slot s is row s of data
            self._view = self.data.numpy()
            self._kernel_hoff = None  # slot s is row s (the kernels compile without offsets)
            return
        self.data = None  # no [capacity, width] tensor: records live in the arena
        self.tcls = tcls.astype(np.int64)
        rows = np.zeros(K, dtype=np.float64)
        for t, b in enumerate(bounds):
            rows[self.tcls[t]] += np.inf if b is None else b
        self.cbound = np.minimum(rows, C).astype(np.int64)  # records a class can ever need
        self.hcls = np.full(C, -1, dtype=np.int64)
        self.hoff = np.zeros(C, dtype=np.int64)
        self.cused = np.zeros(K, dtype=np.int64)
        self.cnfree = np.zeros(K, dtype=np.int64)
        self.ccap = np.zeros(K, dtype=np.int64)
        self.cbase = np.zeros(K, dtype=np.int64)
        self.fbase = np.zeros(K, dtype=np.int64)
        self.fstack = np.zeros(0, dtype=np.int64)
        self.arena = torch.zeros(self.width, dtype=torch.float32, pin_memory=pin_memory)
        self._kernel_hoff = self.hoff
        self._layout(np.zeros(K, dtype=np.int64))

    @property
    def page_locked(self) -> bool:
        """Whether the records live in page-locked memory (asked for with a CUDA device tier)."""
        return bool((self.data if self.uniform else self.arena).is_pinned())

    # -- the mixed layout's pools --------------------------------------------------------
    def _layout(self, ccap: np.ndarray) -> None:
        """Reallocate the arena with pools of ``ccap`` records (each >= its class's
        records in use), copying every record and free stack into place."""
        ccap = np.asarray(ccap, dtype=np.int64)
        cbase = np.concatenate([[0], np.cumsum(ccap * self.cw)[:-1]]).astype(np.int64)
        fbase = np.concatenate([[0], np.cumsum(ccap)[:-1]]).astype(np.int64)
        n = int((ccap * self.cw).sum()) + self.width  # + a widest record of slack for the view
        arena = torch.zeros(n, dtype=torch.float32, pin_memory=self._pin)
        fstack = np.zeros(int(ccap.sum()), dtype=np.int64)
        old, new = self.arena.numpy(), arena.numpy()
        for c in range(self.cw.size):
            m = int(self.cused[c] * self.cw[c])
            new[cbase[c]:cbase[c] + m] = old[self.cbase[c]:self.cbase[c] + m]
            f = int(self.cnfree[c])
            fstack[fbase[c]:fbase[c] + f] = self.fstack[self.fbase[c]:self.fbase[c] + f]
        has = self.hcls >= 0
        c = self.hcls[has]
        self.hoff[has] = cbase[c] + (self.hoff[has] - self.cbase[c]) // self.cw[c] * self.cw[c]
        self.arena, self.ccap, self.cbase, self.fbase, self.fstack = arena, ccap, cbase, fbase, fstack
        self._view = _rows_view(new, self.width)

    def assign(self, slots) -> None:
        """Give each of ``slots`` (host slots, occupied: rows just moved in) a record of
        its row's width; its contents are undefined until written."""
        if self.uniform:
            return
        s = _i64(slots)
        i = 0
        while True:
            i, c = assign_records(s, self.state[0], self.tcls, self.hcls, self.hoff, self.cw, self.cbase, self.ccap,
                                  self.cused, self.cnfree, self.fbase, self.fstack, i)
            if c < 0:
                return self._shrink()
            ccap = self.ccap.copy()
            ccap[c] = max(ccap[c] + 1, min(max(2 * ccap[c], FIRST_RECORDS), self.cbound[c]))
            budget = self.capacity * self.width  # the floats of a tier padded to the widest record
            if int((ccap * self.cw).sum()) > budget:  # never more than that: the other pools give
                ccap = self._fit(c, ccap, budget)  # back their free records, c takes what fits
            self._layout(ccap)

    def _fit(self, c: int, ccap: np.ndarray, budget: int) -> np.ndarray:
        """Pool sizes within ``budget`` floats for a pool ``c`` that must grow: every other
        pool compacted to the records it holds, ``c`` given up to ``ccap[c]`` of what is
        left (at least one more record: the held records of all pools fit in the budget,
        as at most ``capacity`` slots hold one record each, none wider than ``width``)."""
        live = self.cused - self.cnfree
        ccap = ccap.copy()
        for o in range(self.cw.size):
            if o != c and self.ccap[o] > live[o]:
                self._compact(o, int(live[o]))
                ccap[o] = live[o]
        room = (budget - int(np.delete(ccap * self.cw, c).sum())) // int(self.cw[c])
        ccap[c] = max(int(self.ccap[c]) + 1, min(int(ccap[c]), room))
        return ccap

    def _compact(self, c: int, n: int) -> None:
        """Move pool ``c``'s records at or above index ``n`` into free ones below it (``n``
        >= its records in use); its free stack then lists the free ones below ``n``."""
        flat = self.arena.numpy()
        w, base = int(self.cw[c]), int(self.cbase[c])
        held = np.flatnonzero(self.hcls == c)
        idx = (self.hoff[held] - base) // w
        used = np.zeros(n, dtype=np.bool_)
        used[idx[idx < n]] = True
        free = np.flatnonzero(~used)
        movers = held[idx >= n]
        to = free[:movers.size]
        src = (self.hoff[movers] - base)[:, None] + np.arange(w)
        flat[base + to[:, None] * w + np.arange(w)] = flat[base + src]
        self.hoff[movers] = base + to * w
        rest = free[movers.size:]
        self.fstack[self.fbase[c]:self.fbase[c] + rest.size] = rest[::-1]
        self.cnfree[c], self.cused[c] = rest.size, n

    def release(self, slots) -> None:
        """Free the records of those of ``slots`` that are now empty."""
        if self.uniform:
            return
        release_records(_i64(slots), self.state[0], self.hcls, self.hoff, self.cw, self.cbase, self.cnfree,
                        self.fbase, self.fstack)
        self._shrink()

    def _shrink(self) -> None:
        """Halve (at least) every pool whose records are under a quarter in use: its
        records above the new size move into free ones below it (so a pool follows the
        rows held now, not the most it ever held)."""
        live = self.cused - self.cnfree
        shrink = (live * 4 < self.ccap) & (self.ccap > FIRST_RECORDS)
        if not shrink.any():
            return
        ccap = self.ccap.copy()
        for c in np.flatnonzero(shrink):
            n = max(FIRST_RECORDS, 2 * int(live[c]))
            self._compact(int(c), n)
            ccap[c] = n
        self._layout(ccap)

    # -- records ---------------------------------------------------------------------------
    def read(self, slots, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Records ``[n, cols]`` (CPU) of ``slots``: each its first ``min(width, cols)``
        floats, zeros after; into ``out`` (float32 ``[n, cols]``, C-contiguous) if given."""
        if self.uniform:
            idx = slots if isinstance(slots, torch.Tensor) else torch.from_numpy(_i64(slots))
            src = self.data if cols == self.width else self.data[:, :cols]
            if out is None:
                return src.index_select(0, idx.cpu())
            return torch.index_select(src, 0, idx.cpu(), out=out)
        s = _i64(slots)
        if out is None:
            out = torch.empty((s.size, cols), dtype=torch.float32)
        gather_records(self.arena.numpy(), self.hoff, self.hcls, self.cw, s, out.numpy())
        return out

    def write(self, slots, rec: torch.Tensor) -> None:
        """Write ``rec [n, w]`` to the records of ``slots`` (each its first ``min(width,
        w)`` floats; the rest of the record is kept)."""
        if self.uniform:
            idx = slots if isinstance(slots, torch.Tensor) else torch.from_numpy(_i64(slots))
            w = rec.shape[1]
            dst = self.data if w == self.width else self.data[:, :w]
            dst.index_copy_(0, idx.cpu(), rec.cpu())
            return
        scatter_records(self.arena.numpy(), self.hoff, self.hcls, self.cw, _i64(slots),
                        rec.detach().cpu().to(torch.float32).contiguous().numpy())

    def update(self, slots, width: int, fn) -> None:
        """``fn(data, rows)`` changes records ``rows`` of a ``[*, >= width]`` tensor in
        place: here on the records of ``slots`` (read, changed, written back)."""
        if self.uniform:
            return fn(self.data, slots)
        rec = self.read(slots, width)
        fn(rec, torch.arange(rec.shape[0]))
        self.write(slots, rec)

    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """``(rows, hoff)`` for the compiled data plane: slot ``s``'s record is
        ``rows[hoff[s], :width]`` (``rows``: float32, a float-stride view of the storage);
        one width: ``rows`` is the ``[H, W]`` tensor's array and ``hoff`` None (row ``s``;
        a None argument compiles the kernels without the offset path at all)."""
        return self._view, self._kernel_hoff

    def clear(self) -> None:
        super().clear()
        if not self.uniform:
            self.release(np.arange(self.capacity, dtype=np.int64))

    # -- accounting -----------------------------------------------------------------------
    def record_bytes(self) -> int:
        """Bytes of record storage allocated (uniform: capacity x width)."""
        if self.uniform:
            return self.data.numel() * 4
        return self.arena.numel() * 4

    def occupied_bytes(self, resident: list[int], widths: list[int]) -> int:
        """Bytes of the records of the resident rows (``resident[t]`` rows of table ``t``)."""
        if self.uniform:
            return sum(resident) * self.width * 4
        return sum(n * w for n, w in zip(resident, widths)) * 4

    def nbytes(self) -> int:
        return self.record_bytes() + self.capacity * (RECORD + 8 + (0 if self.uniform else 16))  # + hoff, hcls

    def check(self) -> None:
        """Assert every occupied slot holds a record of its row's width, no two share one,
        and the free stacks hold exactly the rest (mixed layout)."""
        if self.uniform:
            return
        kt = self.state[0][:self.capacity]
        occ = kt >= 0
        assert (self.hcls[occ] == self.tcls[kt[occ]]).all(), "host: a row without a record of its width"
        assert np.unique(self.hoff[self.hcls >= 0]).size == int((self.hcls >= 0).sum()), "host: records shared"
        held = np.bincount(self.hcls[self.hcls >= 0], minlength=self.cw.size)
        assert (held + self.cnfree == self.cused).all(), "host: records lost or doubly free"
