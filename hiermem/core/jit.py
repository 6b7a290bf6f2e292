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

import os

import numba

DISABLED = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")


def kernel(fn):
    """Compile ``fn`` as a control-plane kernel (see the module docstring)."""
    return numba.njit(cache=True, nogil=True)(fn)


def inline(fn):
    """A small helper inlined into the kernels that call it (compiled with them)."""
    return numba.njit(cache=True, nogil=True, inline="always")(fn)
