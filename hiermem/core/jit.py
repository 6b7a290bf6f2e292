"""How the control plane's kernels are compiled: one decorator, one place.

Every kernel is ``numba.njit(cache=True, nogil=True)``: compiled once, cached on disk
next to its module (``__pycache__``), so later processes load machine code instead of
compiling, and the GIL is released while it runs (a prefetch thread's placement runs
beside the training loop's Python).  ``NUMBA_DISABLE_JIT=1`` runs every kernel as plain
Python over the same arrays: the parity tests compare the two.

Kernels are serial: a batch's placement is a few microseconds to a few milliseconds of
pointer chasing, where threads would cost more than they save.  numba's thread pool
(used by nothing here today) follows torch's thread count.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")


def _invalidate_stale_cache() -> None:
    """Drop cached machine code compiled from other sources of this package.

    numba keys a cached kernel on its own file's timestamp only, but a kernel compiles
    in the helpers it calls from other files; so the cache is stamped with a hash of
    every kernel source, and dropped whole when any of them changed."""
    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.py")))).hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "kernels.sha256"
    try:
        if stamp.is_file() and stamp.read_text() == digest:
            return
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")) + [cache / "kernels.warm"]:
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # a read-only install: numba falls back to its user cache dir
        pass


_invalidate_stale_cache()
_WARM = Path(__file__).parent / "__pycache__" / "kernels.warm"


def is_warm() -> bool:
    """Whether every kernel was compiled and cached from the current sources."""
    return _WARM.is_file()


def mark_warm() -> None:
    try:
        _WARM.write_text("compiled\n")
    except OSError:  # a read-only install
        pass


_ANNOUNCED: set = set()


def announce_compile(dispatcher, what: str) -> None:
    """Before the first call of a kernel that :mod:`hiermem.store.warm` leaves to its first
    use: a one-line notice when no cached machine code is on disk yet (numba is about to
    compile it), once per process."""
    if DISABLED or id(dispatcher) in _ANNOUNCED:
        return
    _ANNOUNCED.add(id(dispatcher))
    try:
        cached = bool(dispatcher.signatures) or os.path.exists(dispatcher._cache._cache_file._index_path)
    except AttributeError:  # not a caching dispatcher: nothing to say
        return
    if not cached:
        print(f"hiermem: compiling {what} once (cached for later runs) ...", file=sys.stderr, flush=True)


def kernel(fn):
    """Compile ``fn`` as a control-plane kernel (see the module docstring)."""
    return numba.njit(cache=True, nogil=True)(fn)


def tiny(fn):
    """A helper of a few lines, inlined into its callers at numba's IR level: a call
    across compiled functions is never inlined by LLVM, and costs tens of ns."""
    return numba.njit(cache=True, nogil=True, inline="always")(fn)


def leaf(fn):
    """A :func:`helper` that allocates nothing, nor does anything it calls: compiled
    without numba's reference counting (``_nrt=False``).  With it, a call increments and
    decrements the count of every array it passes; without it the per-access replay ran
    1.3x faster (1.38 -> 1.82M accesses/s LRU, same counters; ``commit_`` and its helpers
    as leaves), and the whole replay loop as a leaf (:func:`hiermem.core.replay._run`,
    ``decide_``/``commit_`` inlined) 1.5-2.5x again: numba's atomic reference counts of
    the arrays unpacked and sliced per miss took half the loop's time (``perf``).  numba
    compiles a callee under its caller's flags, so a leaf must never call a function that
    allocates (``np.empty``, ``np.argsort``...) unless that function already has a
    compiled overload for those argument types, which the leaf then calls: the few a
    leaf can reach (the victim search's rebuild and scan, the hash index's rehash) are
    compiled at import, with explicit signatures."""
    return numba.njit(cache=True, nogil=True, _nrt=False)(fn)


def inline(fn):
    """A large function with few call sites, inlined into each at numba's IR level, so
    that the arrays it works on are never passed across a call: a compiled call costs
    about 8 ns per array argument (each array is seven scalars), which made the plan's
    ``decide_``/``commit_`` (45 arrays each) cost more than a per-access miss's work.
    Its arguments are the state tuples (a call of more than 30 arguments compiles to a
    ``*args`` call, which numba does not inline); it unpacks them at the top."""
    return numba.njit(cache=True, nogil=True, inline="always")(fn)


def helper(fn):
    """A helper the kernels call (compiled with them; LLVM inlines the small ones).

    Helpers take arrays one by one, never tuples of arrays: taking an array out of a
    tuple inside a loop costs a reference-count round trip (tens of ns), more than the
    work of a placement step.  Kernels unpack their tuples once, at the top."""
    return numba.njit(cache=True, nogil=True)(fn)


if DISABLED:
    def prefetch(arr, i):
        """Prefetch ``arr[i]`` into the cache (interpreted: nothing)."""

    def f64_bits(x):
        """The bits of float64 ``x`` as an int64."""
        return np.array([x], dtype=np.float64).view(np.int64)[0]
else:
    @intrinsic
    def _f64_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.int64))
        return types.int64(types.float64), codegen

    from llvmlite import ir  # numba's own code generator

    @intrinsic
    def prefetch(typingctx, arr, i):
        """Prefetch ``arr[i]`` (1-D) for writing: one ``llvm.prefetch``, no load, no
        fault on any address.  The slot-state loops of a swap touch a few arrays at random
        slots a row; issued a few rows ahead, those misses overlap instead of queueing."""
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            a = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer2(context, builder, a.data, cgutils.unpack_tuple(builder, a.shape),
                                            cgutils.unpack_tuple(builder, a.strides), aryty.layout, [args[1]],
                                            wraparound=False)
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0i8")
            builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.void(arr, types.intp), codegen

    @tiny
    def f64_bits(x):
        """The bits of float64 ``x`` as an int64 (a register move: no array, no memory)."""
        return _f64_bits(np.float64(x))
