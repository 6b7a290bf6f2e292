"""The fused update off the training thread: a compiled worker that never takes the GIL.

On a GPU the fused backward-optimizer is a kernel launch: the training thread queues it
and goes on to the next batch, and the stream orders it before the next lookup.
:class:`DeferredApply` gives the compiled CPU plane the same shape.  The backward
validates the gradients first, on the training thread (a NaN still raises there and
changes nothing); then, instead of running the fused kernel, it writes the kernel's
arguments (array addresses and shapes) into a mailbox with one compiled call and hands
it over.  A worker thread, waiting *inside compiled code*, runs the same kernel with the
same arguments and raises a done flag (and posts a semaphore).  The store's lock
(:class:`StoreLock`) waits for that before anyone touches rows or placement, so every
later store call sees the update, in the order it was made: the numbers are those of
the synchronous step, bit for bit (same kernel, same inputs).

Why compiled code: a Python thread woken while the training thread runs Python waits
for the GIL up to a switch interval (the pipeline's ``GIL_SLICE``, 0.2 ms), longer than
the update it would overlap (0.07-0.16 ms on the host-backed benchmark step).  The
worker's loop is a ``nogil`` numba function: it waits, runs and signals without the
interpreter.  Why it spins: waking a sleeping core through a semaphore (a futex wake,
an inter-processor interrupt) cost the poster 30-55 us on this project's VMs, and the
worker as much again before it ran.  So the worker learns the pace of the updates (the
gaps between posts, on the poster's clock), sleeps on its semaphore with a deadline until
shortly before the next is due, and spins on an atomic state word around that time
(``LEAD_NS + period / LEAD_DIV`` each side); a job posted while it spins is handed over
with one compare-and-swap, no system call, and one posted outside the window through the
semaphore.  The training thread likewise spins (up to ``AWAIT_SPIN_NS``) for the done
flag before it sleeps.  What the update overlaps: the rest of the backward, the step's
own code, taking the next batch and the forward's glue up to the store's lock.

The arrays the kernel reads stay referenced (:attr:`DeferredApply.held`) until it is
done.  Gradients a caller could still write after the call (the store API's, not the
module's autograd gradient) are copied first.  Only the one-width host layout (the
common case) and kernels that would run on one thread take this path; the rest run
as before.  Linux (glibc semaphores); elsewhere, and under ``NUMBA_DISABLE_JIT``, the
update runs synchronously.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
import weakref

import numba
import numpy as np

from . import kernels as K

#: the optimizer kernels with a worker loop, by the loop's kind code
KINDS = {K.sgd: 0, K.adagrad: 1, K.rowwise_adagrad: 2, K.adam: 3}

# mailbox: [command, then (address, sizes..., [stride]) per array: see _arrays and _post_py;
# the control words each on a cache line of its own]
_CMD = 0
_STOP, _RUN = 0, 1
_STATE, _DONE, _SPUN, _SLEPT, _AT = 40, 48, 56, 57, 58  # the worker's state; job done; jobs caught
# spinning / not; when the job was posted (CLOCK_MONOTONIC ns)
_IDLE, _SPIN, _JOB, _BLOCKED = 0, 1, 2, 3  # states
_BOX = 64
#: the worker's spin around the next job's expected time: ``LEAD_NS + period / LEAD_DIV``
#: each side of it (0.25 ms a side at a 5 ms step), at most ``MAX_SPIN_NS`` in all
LEAD_NS, LEAD_DIV, MAX_SPIN_NS = 100_000, 32, 2_000_000
#: how long the training thread spins for a job's end before it sleeps on the semaphore
AWAIT_SPIN_NS = 2_000_000
_SEM_BYTES = 64  # a glibc sem_t is 32 bytes; each gets its own 64-byte line

_libc = None
_available: bool | None = None


def available() -> bool:
    """Whether the deferred update can run here (Linux glibc semaphores, JIT on)."""
    global _libc, _available
    if _available is None:
        ok = sys.platform.startswith("linux") and os.environ.get("NUMBA_DISABLE_JIT", "0") in ("", "0")
        if ok:
            try:
                import llvmlite.binding as llvm

                libc = ctypes.CDLL(None, use_errno=True)
                for name in ("sem_init", "sem_wait", "sem_post", "sem_destroy"):
                    fn = getattr(libc, name)
                    fn.argtypes = [ctypes.c_void_p] + ([ctypes.c_int, ctypes.c_uint] if name == "sem_init" else [])
                    fn.restype = ctypes.c_int
                # the compiled code calls these by these names (resolved when it loads)
                for name in ("sem_wait", "sem_post", "sem_trywait", "sem_clockwait", "clock_gettime"):
                    llvm.add_symbol("hiermem_" + name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
                _libc = libc
            except (OSError, AttributeError):
                ok = False
        _available = ok
    return _available


if os.environ.get("NUMBA_DISABLE_JIT", "0") in ("", "0"):
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    def _c_call(name):
        @intrinsic
        def call(typingctx, addr):
            """``int name(void *addr)`` of libc (registered by :func:`available`)."""
            sig = types.int32(types.int64)

            def codegen(context, builder, signature, args):
                fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(8).as_pointer()])
                fn = cgutils.get_or_insert_function(builder.module, fnty, "hiermem_" + name)
                return builder.call(fn, [builder.inttoptr(args[0], ir.IntType(8).as_pointer())])
            return sig, codegen
        return call

    _sem_wait, _sem_post, _sem_trywait = _c_call("sem_wait"), _c_call("sem_post"), _c_call("sem_trywait")

    _I8P = ir.IntType(8).as_pointer()
    _I64P = ir.IntType(64).as_pointer()

    @intrinsic
    def _clock_gettime(typingctx, clock, ts):
        """``clock_gettime(clock, (timespec *) ts)``."""
        sig = types.int32(types.int64, types.int64)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), _I8P])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "hiermem_clock_gettime")
            return builder.call(fn, [builder.trunc(args[0], ir.IntType(32)), builder.inttoptr(args[1], _I8P)])
        return sig, codegen

    @intrinsic
    def _sem_clockwait(typingctx, sem, clock, ts):
        """``sem_clockwait(sem, clock, (timespec *) ts)``: 0 when taken, -1 at the deadline."""
        sig = types.int32(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [_I8P, ir.IntType(32), _I8P])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "hiermem_sem_clockwait")
            return builder.call(fn, [builder.inttoptr(args[0], _I8P), builder.trunc(args[1], ir.IntType(32)),
                                     builder.inttoptr(args[2], _I8P)])
        return sig, codegen

    @intrinsic
    def _aload(typingctx, addr):
        """An acquire load of the int64 at ``addr`` (never hoisted out of a spin)."""
        sig = types.int64(types.int64)

        def codegen(context, builder, signature, args):
            return builder.load_atomic(builder.inttoptr(args[0], _I64P), "acquire", 8)
        return sig, codegen

    @intrinsic
    def _astore(typingctx, addr, v):
        """A release store of ``v`` to the int64 at ``addr``."""
        sig = types.void(types.int64, types.int64)

        def codegen(context, builder, signature, args):
            builder.store_atomic(args[1], builder.inttoptr(args[0], _I64P), "release", 8)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def _cas(typingctx, addr, expected, new):
        """Compare-and-swap the int64 at ``addr``; the value found."""
        sig = types.int64(types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            res = builder.cmpxchg(builder.inttoptr(args[0], _I64P), args[1], args[2], "acq_rel", "acquire")
            return builder.extract_value(res, 0)
        return sig, codegen

    _X86 = platform.machine().lower() in ("x86_64", "amd64")

    @intrinsic
    def _pause(typingctx):
        """The spin-loop hint (x86 ``pause``; nothing elsewhere)."""
        sig = types.void()

        def codegen(context, builder, signature, args):
            if _X86:
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                    "llvm.x86.sse2.pause")
                builder.call(fn, [])
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def _vptr(typingctx, addr):
        """The address ``addr`` (an int64) as a ``void *``."""
        sig = types.voidptr(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        return sig, codegen

    def _njit(fn):
        return numba.njit(cache=True, nogil=True)(fn)

    def _inline(fn):
        return numba.njit(cache=True, nogil=True, inline="always")(fn)

    @_inline
    def _f32_2d(box, i):
        return numba.carray(_vptr(box[i]), (box[i + 1], box[i + 2]), np.float32)

    @_inline
    def _i64(box, i):
        return numba.carray(_vptr(box[i]), (box[i + 1],), np.int64)

    @_inline
    def _f32(box, i):
        return numba.carray(_vptr(box[i]), (box[i + 1],), np.float32)

    @_inline
    def _flags(box, i):
        """A strided bool ``[n]`` (a field of the slot records): address, n, stride (bytes)."""
        n, st = box[i + 1], box[i + 2]
        return numba.carray(_vptr(box[i]), (max(n - 1, 0) * st + 1,), np.bool_)[0:n * st:st]

    @_inline
    def _addr(a):
        """An array's data address as an int64 (``ctypes.data`` is unsigned)."""
        return np.int64(a.ctypes.data)

    @_inline
    def _now(ts):
        _clock_gettime(1, _addr(ts))  # CLOCK_MONOTONIC
        return ts[0] * 1_000_000_000 + ts[1]

    @_inline
    def _take(box, job, clk, ts):
        """Wait for a job; whether it is one (not the stop command).

        ``clk``: float64 ``[last arrival (ns), period estimate (ns), arrivals seen]``.
        With a period known, the worker sleeps on the semaphore until ``lead`` before
        the next job is due, then spins (state ``_SPIN``) until ``lead`` after it: a job
        posted then costs its poster a compare-and-swap, not a wake-up system call (on a
        virtual machine an idle core's wake-up costs tens of us on each side).  Outside
        the window, or without a period, the worker sleeps on the semaphore."""
        st = _addr(box) + 8 * _STATE
        got = spun = False
        now = _now(ts)
        if clk[2] >= 2:
            lead = LEAD_NS + clk[1] / LEAD_DIV
            wake = clk[0] + clk[1] - lead
            if wake > now:
                w = np.int64(wake)
                ts[0], ts[1] = w // 1_000_000_000, w % 1_000_000_000
                got = _sem_clockwait(job, 1, _addr(ts)) == 0  # posted before the window
            if not got:
                _astore(st, _SPIN)
                end = min(clk[0] + clk[1] + lead, _now(ts) + MAX_SPIN_NS)
                while not got:
                    for _ in range(64):
                        if _aload(st) == _JOB:
                            got = spun = True
                            break
                        _pause()
                    if got:
                        break
                    if _sem_trywait(job) == 0:  # posted as the window opened (or the stop)
                        got = True
                        break
                    if _now(ts) >= end:
                        break
        if not got:
            if _cas(st, _SPIN, _BLOCKED) == _JOB:  # posted as the window closed
                spun = True
            else:
                while _sem_wait(job) != 0:  # EINTR: wait again
                    pass
        if spun:  # handed over without a system call
            box[_SPUN] += 1
        else:  # through the semaphore
            box[_SLEPT] += 1
        _astore(st, _IDLE)
        arrival = np.float64(box[_AT])  # its poster's clock, not this thread's wake-up
        if clk[2] >= 1:
            gap = arrival - clk[0]
            if clk[2] < 2 or gap < clk[1]:
                clk[1] = gap  # the first period, or an earlier job: spin from the earliest
            elif gap < 2 * clk[1]:
                clk[1] = 0.9 * clk[1] + 0.1 * gap  # later ones move it up slowly
            # (a longer gap is a pause, e.g. evaluation: the pace is kept)
        clk[0] = arrival
        clk[2] = min(clk[2] + 1, 2)
        return box[_CMD] == _RUN

    @_inline
    def _finish(box, done):
        _astore(_addr(box) + 8 * _DONE, 1)
        _sem_post(done)

    @_inline
    def _arrays(box):
        # the layout :meth:`DeferredApply.submit` writes
        return (_f32_2d(box, 1), _f32_2d(box, 4), box[7], _flags(box, 8), _flags(box, 11), _i64(box, 14),
                _i64(box, 16), _i64(box, 18), _i64(box, 20), _i64(box, 22), _i64(box, 24), _i64(box, 26),
                _i64(box, 28), _f32_2d(box, 30), _f32(box, 33), _f32(box, 35))

    @_njit
    def _loop_sgd(box, hp, job, done):
        n = 0
        clk, ts = np.zeros(3), np.zeros(2, dtype=np.int64)
        while _take(box, job, clk, ts):
            a = _arrays(box)
            K.sgd(a[0], a[1], None, a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14],
                  a[15], hp[0])
            n += 1
            _finish(box, done)
        _finish(box, done)
        return n

    @_njit
    def _loop_adagrad(box, hp, job, done):
        n = 0
        clk, ts = np.zeros(3), np.zeros(2, dtype=np.int64)
        while _take(box, job, clk, ts):
            a = _arrays(box)
            K.adagrad(a[0], a[1], None, a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
                      a[14], a[15], hp[0], hp[1])
            n += 1
            _finish(box, done)
        _finish(box, done)
        return n

    @_njit
    def _loop_rowwise_adagrad(box, hp, job, done):
        n = 0
        clk, ts = np.zeros(3), np.zeros(2, dtype=np.int64)
        while _take(box, job, clk, ts):
            a = _arrays(box)
            K.rowwise_adagrad(a[0], a[1], None, a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                              a[13], a[14], a[15], hp[0], hp[1])
            n += 1
            _finish(box, done)
        _finish(box, done)
        return n

    @_njit
    def _loop_adam(box, hp, job, done):
        n = 0
        clk, ts = np.zeros(3), np.zeros(2, dtype=np.int64)
        while _take(box, job, clk, ts):
            a = _arrays(box)
            K.adam(a[0], a[1], None, a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14],
                   a[15], hp[0], hp[1], hp[2])
            n += 1
            _finish(box, done)
        _finish(box, done)
        return n

    LOOPS = (_loop_sgd, _loop_adagrad, _loop_rowwise_adagrad, _loop_adam)

    def _post_py(box, hp, job, dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds,
                 src, grad, scale, coef, h0, h1, h2):
        """Write a job's arguments into the mailbox (the layout :func:`_arrays` reads) and
        post it: one compiled call, whose signature admits only the kernel's types."""
        box[1], box[2], box[3] = dev.ctypes.data, dev.shape[0], dev.shape[1]
        box[4], box[5], box[6] = host.ctypes.data, host.shape[0], host.shape[1]
        box[7] = cap
        box[8], box[9], box[10] = dev_dirty.ctypes.data, dev_dirty.size, dev_dirty.strides[0]
        box[11], box[12], box[13] = host_dirty.ctypes.data, host_dirty.size, host_dirty.strides[0]
        i = 14
        for a in (gslot, t, dims, perm, starts, counts, bounds, src):
            box[i], box[i + 1] = a.ctypes.data, a.size
            i += 2
        box[30], box[31], box[32] = grad.ctypes.data, grad.shape[0], grad.shape[1]
        box[33], box[34], box[35], box[36] = scale.ctypes.data, scale.size, coef.ctypes.data, coef.size
        hp[0], hp[1], hp[2] = h0, h1, h2
        box[_AT] = _now(np.zeros(2, dtype=np.int64))
        box[_CMD] = _RUN
        box[_DONE] = 0
        if _cas(_addr(box) + 8 * _STATE, _SPIN, _JOB) == _SPIN:
            return 0  # the worker spins for it: no system call
        return _sem_post(job)

    @_njit
    def _await(box, done):
        """Return when the job posted is done: spin up to ``AWAIT_SPIN_NS``, then sleep."""
        flag = _addr(box) + 8 * _DONE
        ts = np.zeros(2, dtype=np.int64)
        if _aload(flag) == 0:
            end = _now(ts) + AWAIT_SPIN_NS
            while _aload(flag) == 0 and _now(ts) < end:
                for _ in range(64):
                    _pause()
        while _sem_wait(done) != 0:  # (at once when it is done)
            pass
        return 0

    _SIG = ("int32(int64[::1], float64[::1], int64, float32[:, ::1], float32[:, ::1], int64, boolean[:], boolean[:], "
            + "int64[::1], " * 8 + "float32[:, ::1], float32[::1], float32[::1], float64, float64, float64)")
    _post_fn = None

    def _post(*args):
        """:func:`_post_py`, compiled at its first use (``import hiermem`` compiles nothing);
        arguments of other types raise TypeError."""
        global _post_fn
        if _post_fn is None:
            _post_fn = numba.njit(_SIG, cache=True, nogil=True)(_post_py)
        return _post_fn(*args)
else:  # interpreted: the update runs synchronously (available() is False)
    LOOPS = ()

    def _post(*args):
        raise RuntimeError("the deferred update needs numba's JIT")

    _await = _post


def _c(a: np.ndarray, dtype) -> bool:
    return a.dtype == dtype and a.flags.c_contiguous


def _flag(a: np.ndarray) -> bool:
    """A bool ``[n]`` with a positive stride (the slot records' dirty field)."""
    return a.dtype == np.bool_ and a.ndim == 1 and a.strides[0] > 0


class _Worker:
    """One compiled loop on its own thread, for one optimizer kind."""

    def __init__(self, kind: int):
        self.box = np.zeros(_BOX, dtype=np.int64)
        self.hp = np.zeros(4, dtype=np.float64)
        self.sems = np.zeros(2 * _SEM_BYTES, dtype=np.uint8)
        self.job, self.done = self.sems.ctypes.data, self.sems.ctypes.data + _SEM_BYTES
        for s in (self.job, self.done):
            if _libc.sem_init(s, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "sem_init failed")
        loop, box, hp, job, done, sems = LOOPS[kind], self.box, self.hp, self.job, self.done, self.sems

        def run():
            numba.set_num_threads(1)  # (this thread's count: one task per job)
            loop(box, hp, job, done)
            _ = sems  # the semaphores live as long as the loop

        self.thread = threading.Thread(target=run, name=f"hiermem-apply-{kind}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.box[_CMD] = _STOP
            _libc.sem_post(self.job)
            self.thread.join()
        for s in (self.job, self.done):
            _libc.sem_destroy(s)


class DeferredApply:
    """The store's deferred fused updates: at most one in flight (see the module docstring).

    :meth:`submit` hands a kernel's arguments to the worker of its kind and returns;
    :meth:`wait` returns when it is applied (at once when none is in flight).  Not
    thread-safe on its own: the store's lock guards both (its :class:`StoreLock` calls
    :meth:`wait` on entry).
    """

    def __init__(self, enabled: bool = True) -> None:
        #: whether :meth:`accepts` any update (the store's ``deferred_updates``)
        self.enabled = bool(enabled) and available()
        self.pending: _Worker | None = None
        self.held: tuple | None = None  # the in-flight job's arrays, alive until it is done
        self.submitted = 0
        self._workers: dict[int, _Worker] = {}
        self._copies: dict[str, np.ndarray] = {}
        self._closed = False

    def accepts(self, kernel, host: np.ndarray, hoff) -> bool:
        """Whether ``kernel`` over this host layout can be deferred."""
        return (self.enabled and not self._closed and hoff is None and kernel in KINDS and _c(host, np.float32))

    def _copy(self, name: str, a: np.ndarray) -> np.ndarray:
        buf = self._copies.get(name)
        if buf is None or buf.size < a.size:
            buf = self._copies[name] = np.empty(max(a.size, 1 << 14), dtype=a.dtype)
        out = buf[:a.size].reshape(a.shape)
        np.copyto(out, a)
        return out

    def submit(self, kernel, dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds,
               src, grad, scale, coef, hp, copy_grad: bool) -> bool:
        """Start ``kernel(dev, host, None, cap, ...)`` on the worker (arguments as the
        kernel's); False (nothing started) when an argument is not of the kernel's types
        and layouts (C-contiguous, but for the two dirty-flag fields)."""
        self.wait()
        kind = KINDS[kernel]
        w = self._workers.get(kind)
        if w is None:
            w = self._workers[kind] = _Worker(kind)
        if copy_grad:
            grad = self._copy("grad", grad)
        if scale.size:
            scale = self._copy("scale", scale)  # the caller's weights, perhaps
        hp = tuple(hp) + (0.0,) * (3 - len(hp))
        try:
            rc = _post(w.box, w.hp, w.job, dev, host, cap, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts,
                       bounds, src, grad, scale, coef, *hp)
        except TypeError:
            return False  # an argument of another type or layout: the caller runs it here
        if rc != 0:
            raise OSError(ctypes.get_errno(), "sem_post failed")
        self.held = (dev, host, dev_dirty, host_dirty, gslot, t, dims, perm, starts, counts, bounds, src, grad,
                     scale, coef)
        self.pending = w
        self.submitted += 1
        return True

    def wait(self) -> None:
        """Return when the update in flight (if any) is applied."""
        w = self.pending
        if w is None:
            return
        _await(w.box, w.done)  # (compiled, without the GIL)
        self.pending = None
        self.held = None

    def close(self) -> None:
        """Wait for the update in flight and stop the workers (idempotent)."""
        self.wait()
        self._closed = True
        for w in self._workers.values():
            w.stop()
        self._workers.clear()


class StoreLock:
    """A store's re-entrant lock that, on entry, waits for its deferred update.

    ``with lock:`` is what every store call does; the wait makes the update in flight
    land before the holder reads or moves a row, so callers see the synchronous order.
    :attr:`unfenced` is the plain lock, for the few calls that touch neither rows nor
    what the update reads (a prefetch's unpin).
    """

    __slots__ = ("_lock", "acquire", "release", "deferred", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.acquire, self.release = self._lock.acquire, self._lock.release
        self.deferred: DeferredApply | None = None

    def __enter__(self):
        self._lock.acquire()
        d = self.deferred
        if d is not None and d.pending is not None:
            try:
                d.wait()
            except BaseException:
                self._lock.release()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @property
    def unfenced(self) -> threading.RLock:
        return self._lock


def close_on_collect(owner, deferred: DeferredApply) -> None:
    """Stop ``deferred``'s workers when ``owner`` is collected without being closed."""
    weakref.finalize(owner, deferred.close)
