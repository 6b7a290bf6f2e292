"""Vector and memory primitives of the data-plane kernels (numba intrinsics).

numba compiles with LLVM's SLP vectoriser off, and cannot tell LLVM that a kernel's
accumulator does not alias the tier arrays it reads; so ``acc[c] += row[c]`` over a row
compiles to one scalar add *and store* per column, and a row read from memory (a cold
row, or one evicted by the model's dense layers between steps) stalls the loop in turn.
These intrinsics say what FBGEMM's kernels say in C++:

* ``stack_f32(n)``: a float32 ``[n]`` scratch array in the kernel's stack frame (no
  allocation, no reference count; LLVM knows it aliases nothing);
* ``add8``/``addmul8``/``mov8``/``movmul8``: eight columns at once (one AVX register),
  each lane rounding exactly as the scalar ``a + b`` / ``a + b * w`` it replaces (no
  fused multiply-add), so results are bit-identical to the scalar loops;
* ``prefetch_row``: ask the cache for a row a few iterations before it is read.

Every one also runs as plain Python under ``NUMBA_DISABLE_JIT=1`` (the parity tests).
Arrays are C-contiguous float32; indices are not wrapped (never negative here).
"""

from __future__ import annotations

import os

import numba
import numpy as np

from ..core.jit import prefetch as prefetch_item  # noqa: F401  (one item prefetch, the control plane's)

#: floats per vector (one 256-bit register)
V = 8

if os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0"):
    def stack_f32(n):
        """A float32 ``[n]`` scratch array (interpreted: a heap array)."""
        return np.empty(n, dtype=np.float32)

    def add8(acc, i, src, r, c):
        """``acc[i:i+8] += src[r, c:c+8]``."""
        acc[i:i + V] += src[r, c:c + V]

    def addmul8(acc, i, src, r, c, w):
        """``acc[i:i+8] += src[r, c:c+8] * w`` (a multiply, then an add)."""
        acc[i:i + V] += src[r, c:c + V] * np.float32(w)

    def mov8(acc, i, src, r, c):
        """``acc[i:i+8] = src[r, c:c+8]``."""
        acc[i:i + V] = src[r, c:c + V]

    def movmul8(acc, i, src, r, c, w):
        """``acc[i:i+8] = src[r, c:c+8] * w``."""
        acc[i:i + V] = src[r, c:c + V] * np.float32(w)

    def store8(dst, r, c, acc, i):
        """``dst[r, c:c+8] = acc[i:i+8]``."""
        dst[r, c:c + V] = acc[i:i + V]

    def axpy8(dst, r, c, acc, i, a):
        """``dst[r, c:c+8] += a * acc[i:i+8]`` (a multiply, then an add)."""
        dst[r, c:c + V] += np.float32(a) * acc[i:i + V]

    def prefetch_row(arr, r, nbytes):
        """Prefetch ``nbytes`` of row ``r`` of ``arr`` (interpreted: nothing)."""

else:
    from llvmlite import ir  # numba's own code generator (a dependency of numba)
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    _VT = ir.VectorType(ir.FloatType(), V)
    _I8P = ir.IntType(8).as_pointer()
    _I32 = ir.IntType(32)

    def _ptr(context, builder, aryty, ary, idx):
        a = context.make_array(aryty)(context, builder, ary)
        return cgutils.get_item_pointer2(context, builder, a.data, cgutils.unpack_tuple(builder, a.shape),
                                         cgutils.unpack_tuple(builder, a.strides), aryty.layout, idx,
                                         wraparound=False)

    def _splat(builder, x):
        v = ir.Constant(_VT, ir.Undefined)
        for k in range(V):
            v = builder.insert_element(v, x, ir.Constant(_I32, k))
        return v

    def _vec(context, builder, aryty, ary, idx):
        return builder.bitcast(_ptr(context, builder, aryty, ary, idx), _VT.as_pointer())

    @intrinsic
    def stack_f32(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        size = n.literal_value
        arrty = types.Array(types.float32, 1, "C")

        def codegen(context, builder, sig, args):
            buf = cgutils.alloca_once(builder, ir.ArrayType(ir.FloatType(), size))
            ary = context.make_array(arrty)(context, builder)
            intp = context.get_constant
            context.populate_array(ary, data=builder.bitcast(buf, ir.FloatType().as_pointer()),
                                   shape=[intp(types.intp, size)], strides=[intp(types.intp, 4)],
                                   itemsize=intp(types.intp, 4), meminfo=None)
            return ary._getvalue()
        return arrty(n), codegen

    def _acc_src(op):
        """An intrinsic ``f(acc, i, src, r, c[, w])``: ``acc[i:i+8] (op)= src[r, c:c+8] (* w)``."""
        def typer(typingctx, acc, i, src, r, c, *w):
            def codegen(context, builder, sig, args):
                pa = _vec(context, builder, sig.args[0], args[0], [args[1]])
                v = builder.load(_vec(context, builder, sig.args[2], args[2], [args[3], args[4]]), align=4)
                if w:
                    ws = builder.fptrunc(args[5], ir.FloatType()) if sig.args[5] == types.float64 else args[5]
                    v = builder.fmul(v, _splat(builder, ws))
                if op == "add":
                    v = builder.fadd(builder.load(pa, align=4), v)
                builder.store(v, pa, align=4)
                return context.get_dummy_value()
            return types.void(acc, types.intp, src, types.intp, types.intp, *w), codegen
        return typer

    @intrinsic
    def add8(typingctx, acc, i, src, r, c):
        return _acc_src("add")(typingctx, acc, i, src, r, c)

    @intrinsic
    def addmul8(typingctx, acc, i, src, r, c, w):
        return _acc_src("add")(typingctx, acc, i, src, r, c, w)

    @intrinsic
    def mov8(typingctx, acc, i, src, r, c):
        return _acc_src("mov")(typingctx, acc, i, src, r, c)

    @intrinsic
    def movmul8(typingctx, acc, i, src, r, c, w):
        return _acc_src("mov")(typingctx, acc, i, src, r, c, w)

    @intrinsic
    def store8(typingctx, dst, r, c, acc, i):
        def codegen(context, builder, sig, args):
            v = builder.load(_vec(context, builder, sig.args[3], args[3], [args[4]]), align=4)
            builder.store(v, _vec(context, builder, sig.args[0], args[0], [args[1], args[2]]), align=4)
            return context.get_dummy_value()
        return types.void(dst, types.intp, types.intp, acc, types.intp), codegen

    @intrinsic
    def axpy8(typingctx, dst, r, c, acc, i, a):
        def codegen(context, builder, sig, args):
            pd = _vec(context, builder, sig.args[0], args[0], [args[1], args[2]])
            av = args[5] if sig.args[5] == types.float32 else builder.fptrunc(args[5], ir.FloatType())
            v = builder.load(_vec(context, builder, sig.args[3], args[3], [args[4]]), align=4)
            v = builder.fmul(_splat(builder, av), v)
            builder.store(builder.fadd(builder.load(pd, align=4), v), pd, align=4)
            return context.get_dummy_value()
        return types.void(dst, types.intp, types.intp, acc, types.intp, a), codegen

    def _prefetch(builder, ptr, write):
        fnty = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, _I8P), ir.Constant(_I32, int(write)), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])

    @intrinsic
    def prefetch_row(typingctx, arr, r, nbytes):
        def codegen(context, builder, sig, args):
            p = builder.bitcast(_ptr(context, builder, sig.args[0], args[0], [args[1], context.get_constant(
                types.intp, 0)]), _I8P)
            # one prefetch per 64-byte line of the first nbytes (a short loop in IR)
            with cgutils.for_range_slice(builder, context.get_constant(types.intp, 0), args[2],
                                         context.get_constant(types.intp, 64)) as (off, _):
                _prefetch(builder, builder.gep(p, [off]), False)
            return context.get_dummy_value()
        return types.void(arr, types.intp, types.intp), codegen

