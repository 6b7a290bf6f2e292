"""Control arrays to the device in one copy, and row copies on a side stream (CUDA).

The control plane decides a batch on the CPU; the data plane on a CUDA device then
needs a handful of small index arrays there (each distinct row's slot, the copies up
and down, each id's slot, the bags' offsets, the sort order, ...).  :class:`Stager`
packs them into one pinned byte buffer, sends it with one ``non_blocking`` copy and
hands back typed views of the device copy.  On the CPU the same packing runs when asked
(``pack=True``: the torch plane's CPU stores, so the CPU tests exercise it) and is
skipped otherwise (the arrays are used where they are).

:class:`PinnedRing` holds the reusable pinned buffers: a buffer whose last copy may
still be in flight is never rewritten (its event is queried, never waited on; a busy
ring grows), so reuse costs no synchronisation.

:class:`CopyStream` is the store's side stream for row movement between the pinned
host tier and the device tier (a no-op on the CPU).  :func:`inherent_wait` is the one
place the store makes the CPU wait for the device (see docs/dataplane.md, "CUDA"): it
counts every wait that actually blocked, by reason.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import torch

_ALIGN = 8  # every array starts at a multiple of 8 bytes: any dtype's view is aligned

#: dtype of numpy arrays -> torch dtype of their views
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool,
           np.dtype(np.int32): torch.int32}


def layout(arrays: Sequence[np.ndarray | None]) -> tuple[list[int], int]:
    """Byte offset of each array in the packed buffer (aligned), and its total size."""
    offs, pos = [], 0
    for a in arrays:
        offs.append(pos)
        if a is not None:
            pos += -(-a.nbytes // _ALIGN) * _ALIGN
    return offs, pos


def pack_into(buf: torch.Tensor, arrays: Sequence[np.ndarray | None], offs: Sequence[int]) -> None:
    """Copy ``arrays`` into the uint8 tensor ``buf`` (CPU) at ``offs``."""
    raw = buf.numpy()
    for a, o in zip(arrays, offs):
        if a is not None and a.size:
            raw[o:o + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def views(buf: torch.Tensor, arrays: Sequence[np.ndarray | None], offs: Sequence[int]) -> list[torch.Tensor | None]:
    """Typed views of the packed ``buf`` (any device) shaped as ``arrays``."""
    out: list[torch.Tensor | None] = []
    for a, o in zip(arrays, offs):
        if a is None:
            out.append(None)
            continue
        n = -(-a.nbytes // _ALIGN) * _ALIGN
        v = buf[o:o + n].view(_DTYPES[a.dtype])[:a.size] if n else torch.empty(0, dtype=_DTYPES[a.dtype],
                                                                               device=buf.device)
        out.append(v.view(a.shape))
    return out


class PinnedRing:
    """Reusable host buffers (pinned on CUDA), none rewritten while a copy may read it.

    ``take(nbytes)`` returns a buffer whose copies recorded with :meth:`done` have all
    completed (``Event.query()``: no wait); when every buffer is still busy, or too
    small, a new one is made, so the ring grows to the depth the device lags by.
    Not thread-safe: the store's lock guards it.
    """

    def __init__(self, pinned: bool, dtype: torch.dtype = torch.uint8) -> None:
        self.pinned = pinned
        self.dtype = dtype
        self._bufs: list[list] = []  # [tensor, event or None]

    def take(self, numel: int) -> torch.Tensor:
        for e in self._bufs:
            buf, ev = e
            if buf.numel() >= numel and (ev is None or ev.query()):
                e[1] = None
                return buf[:numel]
        free = [e for e in self._bufs if e[1] is None or e[1].query()]
        size = max(1024, 1 << max(0, numel - 1).bit_length())
        buf = torch.empty(size, dtype=self.dtype, pin_memory=self.pinned)
        if free and len(self._bufs) >= 4:  # replace a small idle buffer rather than grow the ring
            free[0][0], free[0][1] = buf, None
        else:
            self._bufs.append([buf, None])
        return buf[:numel]

    def done(self, view: torch.Tensor) -> None:
        """Record (on the current CUDA stream) that ``view``'s buffer was just read or
        written by a queued copy; a no-op for unpinned buffers."""
        if not self.pinned:
            return
        ptr = view.untyped_storage().data_ptr()
        for e in self._bufs:
            if e[0].untyped_storage().data_ptr() == ptr:
                ev = torch.cuda.Event()
                ev.record()
                e[1] = ev
                return

    def __len__(self) -> int:
        return len(self._bufs)


class Stager:
    """Sends a batch's control arrays to ``device`` in one host-to-device copy.

    ``send(arrays, pack)`` returns one tensor on the device per array (None for None),
    of its dtype and shape.  On CUDA the arrays are packed into a pinned buffer of the
    ring, copied with one ``non_blocking`` copy on the current stream, and the device
    buffer is kept alive for every stream named in ``streams`` (``record_stream``).
    On the CPU: packed into one buffer and viewed when ``pack`` (what a CUDA store does,
    less the copy), else the arrays' own memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ring = PinnedRing(pinned=self.cuda)
        self.copies = 0  # packed sends: one host-to-device copy each on CUDA

    def send(self, arrays: Sequence[np.ndarray | None], pack: bool = True,
             streams: Sequence = ()) -> list[torch.Tensor | None]:
        if not self.cuda and not pack:
            return [None if a is None else torch.from_numpy(a) for a in arrays]
        offs, nbytes = layout(arrays)
        host = self.ring.take(nbytes)
        pack_into(host, arrays, offs)
        self.copies += 1
        if not self.cuda:
            return views(host.clone(), arrays, offs)  # the ring's buffer is reused next send
        dev = host.to(self.device, non_blocking=True)
        self.ring.done(host)
        for s in streams:
            dev.record_stream(s)
        return views(dev, arrays, offs)


class CopyStream:
    """The store's side stream for row copies (CUDA); every method a no-op on the CPU.

    ``with cs:`` runs its body on the side stream after everything already queued on
    the current stream (and on the default stream, when called from a thread on another
    stream, e.g. the prefetch pipeline's); on leaving, the current stream waits for the
    copies (a device-side wait: the host does not block).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._outer = None
        self._ctx = None

    def __enter__(self) -> "CopyStream":
        if self.stream is not None:
            self._outer = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(self._outer)
            default = torch.cuda.default_stream(self.device)
            if default != self._outer:  # a prefetch thread's stream: the training loop's queued
                # kernels (on the default stream) may still read a slot this plan overwrites
                self.stream.wait_stream(default)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            self._ctx.__exit__(*exc)
            self._outer.wait_stream(self.stream)
            self._ctx = self._outer = None

    def keep(self, *tensors: torch.Tensor | None) -> None:
        """Tensors made on the compute stream and used on the side stream (inside
        ``with``): their memory is not reused before the side stream's work is done."""
        if self.stream is None:
            return
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(self.stream)

    def event(self):
        """An event recorded now on the current stream (None on the CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev


#: waits that blocked the CPU on the device, by reason (see :func:`inherent_wait`)
WAITS: Counter = Counter()


def inherent_wait(event, why: str) -> None:
    """Wait for ``event`` (None: nothing to wait for) before the CPU reads memory the
    device writes; counts it under ``why`` in :data:`WAITS` when it actually blocked."""
    if event is None or event.query():
        return
    WAITS[why] += 1
    event.synchronize()


def to_host(x: torch.Tensor, why: str) -> torch.Tensor:
    """``x`` on the CPU: an inherent device-to-host sync (counted) when ``x`` is on CUDA."""
    if x.device.type == "cpu":
        return x
    WAITS[why] += 1
    return x.cpu()
