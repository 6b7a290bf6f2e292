"""Compile every kernel once, when the cache holds none, with a one-line notice.

The first store a process opens (and the first simulator) calls :func:`ensure_compiled`;
``import hiermem`` compiles nothing.  With a warm cache it only checks a stamp file (the
kernels load lazily, on first use); on a fresh install it compiles everything then, so
the first batch of a training run is not the one that waits.  The
kernels compile in two processes at once when the machine has a second core (numba
compiles on one thread; both write the same on-disk caches), in halves of about equal
compile time (measured: ~33 s each on this project's 2-core machines): this process the
control plane (placement decisions and commit) and the store's batch helpers; a child
the data plane's lookup and fused SGD (called directly, so the child compiles none of
the control plane).  What only some users run compiles at its
first use instead, cached then: the other fused optimizers (Adagrad, row-wise Adagrad,
Adam; ~4 s each) and the simulator's replay loop (~20 s, with its own one-line notice;
:func:`hiermem.core.jit.announce_compile`).  ``NUMBA_DISABLE_JIT=1`` skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..core import jit

_CHILD = "HIERMEM_WARM_CHILD"  # set in the child: its own import must not warm again


def _exercise(part: int | None = None) -> None:
    """Call each kernel on tiny inputs of the types the store passes: ``part`` 0 the
    index, policy, victim and decide kernels; 1 commit and abort; None both.  (The
    simulator's replay loop compiles at its first use.)"""
    from ..core.policies import PolicySpec
    from ..tiers.slots import SlotTier
    from ..types import Tier
    from ..core import index as ixk
    from ..core import plan as P
    from ..core import policy as pk
    from ..core import victims as vk
    from ..core.index import KeyIndex

    i64 = np.int64
    for sizes in ([50, 50], [None, None]):
        ix = KeyIndex(12, sizes)
        dev = SlotTier(Tier.DEVICE, 4, 0, "cpu", PolicySpec("lru"), base=0)
        host = SlotTier(Tier.HOST, 8, 0, "cpu", PolicySpec("lru"), base=4)
        counters = np.zeros((2, 3, 5), dtype=i64)
        ws, res = P.workspace(8)
        bt = np.array([0, 0, 1, 1, 1], dtype=i64)
        if part in (None, 0):
            t, k = np.array([0, 1], dtype=i64), np.array([3, 4], dtype=i64)
            ix.insert(t, k, np.array([0, 5], dtype=i64))
            ix.find(t, k)
            ix.move_slots(np.array([0], dtype=i64), np.array([1], dtype=i64))
            ix.items()
            ix.remove_slots(np.array([1, 5], dtype=i64))
            ixk.rehash(ix.meta, ix.tab, ix.rev) if not ix.direct else None
            P.decide(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt,
                     np.array([1, 2, 1, 2, 3], dtype=i64), ws, res)
            dev.pin(np.array([0], dtype=i64), 1)
            pol = dev.policy
            pk.access(pol.state, np.array([0], dtype=i64), np.array([9], dtype=i64), np.array([1], dtype=i64), False)
            pk.carry_in(pol.state, np.array([0], dtype=i64), np.array([9], dtype=i64), np.zeros(1),
                        np.ones(1, dtype=i64))
            pk.lookahead_keys(pol.state, np.array([0], dtype=i64), np.array([1], dtype=i64))
            out = np.empty(2, dtype=i64)
            vk.victims(pol.state, dev.state[0], dev.state[3], dev.state[6], 1, 3, 4, out)
            vk.scan(pol.state, dev.state[0], dev.state[3], dev.state[6], 1, out)
            vk.check(pol.state, dev.state[0])
        if part in (None, 1):
            for step in range(3):  # decide (or nothing: res all zero) then commit
                bk = np.array([1, 2, 1, 2, 3 + step], dtype=i64)
                if part is None:
                    P.decide(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk, ws, res)
                P.commit(ix.arrays, dev.state, dev.policy.state, host.state, host.policy.state, bt, bk,
                         np.arange(5, dtype=i64), np.ones(5, dtype=i64), True, ws, res, counters)
            P.abort(dev.policy.state, host.policy.state)
            from ..core import written as wk  # the simulator's backing (res all zero: nothing to do)
            res[:] = 0
            rb, bits, io = np.zeros(2, dtype=i64), np.zeros(8, dtype=np.uint8), np.zeros(16, dtype=i64)
            wk.fetch(ws, res, bt, bk, rb, bits, io, 256)
            wk.write_back(ws, res, dev.state[0], dev.state[1], host.state[0], host.state[1], dev.capacity, host.base,
                          rb, bits, io, 256)
            wk.moved(res, io, 256)


def _exercise_kernels(part: int | None = None) -> None:
    """Call the data plane's compiled kernels directly on tiny arrays of the types
    :class:`~hiermem.dataplane.planes.CompiledPlane` passes (no store, so none of the
    control plane's kernels compile with them): ``part`` 0 (or None) the pooled lookup,
    fused SGD (the default optimizer), the gradient check and the host tier's record
    pools; 1 nothing (the other process's half is the control plane's commit).  The
    other fused optimizers (Adagrad, row-wise Adagrad, Adam) are not warmed here: each
    compiles at its optimizer's first update (~4 s, then cached for later processes),
    which keeps the first import within its minute."""
    from ..dataplane import kernels as K
    from ..dataplane.planes import FUSED, start_numba_threads
    from ..core.layout import slot_records  # the dirty bits are fields of the tiers' slot records
    from ..dataplane.optim import SGD

    start_numba_threads()  # before the first parallel kernel, which would start it and change torch's count
    f32, i64 = np.float32, np.int64
    dev, host = np.zeros((4, 12), dtype=f32), np.zeros((8, 12), dtype=f32)
    hoff = None  # a host tier of one record width (mixed widths compile on first use)
    gslot = np.array([0, 5], dtype=i64)  # a device row and a host row
    src = np.array([0, 0, 1], dtype=i64)  # positions' bags
    if part in (None, 0):
        K.pool(dev, host, hoff, 4, gslot, np.array([0, 1, 1], dtype=i64), np.array([0, 2], dtype=i64), 3,
               np.zeros(0, dtype=f32), False, np.zeros((2, 4), dtype=f32), 2)
    grad = np.ones((2, 4), dtype=f32)
    for opt in (SGD(lr=0.1),) if part in (None, 0) else ():
        kernel, params = FUSED[type(opt)]
        hp, coef = params(opt, np.ones(1, dtype=i64))
        kernel(dev, host, hoff, 4, slot_records(4)[4], slot_records(8)[4], gslot, np.zeros(2, dtype=i64),
               np.array([4], dtype=i64), np.arange(3, dtype=i64), np.array([0, 1], dtype=i64),
               np.array([1, 2], dtype=i64), np.array([0, 2], dtype=i64), src, grad, np.zeros(0, dtype=f32),
               np.zeros(0, dtype=f32) if coef is None else coef, *hp)
    if part in (None, 0):
        K.max_abs(grad, 2, 4, 1)
        K.rows_up(dev, host, None, None, np.zeros(0, dtype=i64), np.array([1], dtype=i64), np.array([0], dtype=i64),
                  K.AHEAD)  # a placement's host -> device copy (one record width)
        K.swap_rows(dev, host, np.array([1], dtype=i64), np.array([2], dtype=i64), np.array([3], dtype=i64),
                    np.array([1], dtype=i64), np.empty((1, 12), dtype=f32), K.AHEAD)  # ... and both ways at once
        _exercise_host()


def _exercise_host() -> None:
    """The host tier's record pools (mixed widths): assign, write, read, release; and
    the disk tier's write combining (:mod:`hiermem.tiers.combine`)."""
    import torch

    from ..core.policies import PolicySpec
    from ..tiers.host import HostTier

    h = HostTier(2, [4, 12], [1, None], PolicySpec("lru"), base=4)
    s = np.array([0, 1], dtype=np.int64)
    h.state[0][:] = [0, 1]
    h.assign(s)
    h.write(s, torch.ones((2, 12)))
    h.read(s, 12)
    h.state[0][:] = -1
    h.release(s)
    from ..tiers.combine import WriteCombiner  # the disk tier's write combining

    c = WriteCombiner(8)
    c.put(s, s, np.ones((2, 4), dtype=np.float32), [4, 4])
    c.lookup(0, s, 4, np.zeros(2, dtype=bool), np.zeros((2, 4), dtype=np.float32))


def _exercise_dataplane(store_class, plane: str = "compiled") -> None:
    """Train one tiny batch of bags (sum, mean, per-sample weights) per warmed optimizer
    through a CPU store on data plane ``plane``, as the embedding module's forward and
    backward do (``lookup_bags``, then ``update_bags``): compiles the data plane's kernels
    (:mod:`hiermem.dataplane`), cached beside them, so the first training step does not
    wait for them either.  ``store_class`` is :class:`~hiermem.HierarchicalStore` (given by
    the caller: the store module calls this one, not the other way round)."""
    import tempfile

    import torch

    from ..dataplane import plane_named
    from ..dataplane.optim import SGD
    from ..types import StoreConfig, TableSpec

    tables = [TableSpec("a", num_rows=50, dim=4), TableSpec("b", num_rows=None, dim=4)]
    t, k = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([1, 2, 3, 1, 7, 9])
    offsets = torch.tensor([0, 2, 3, 5])  # bags a:[1, 2] a:[3] b:[1, 7] b:[9]
    with tempfile.TemporaryDirectory(prefix="hiermem-warm-") as td:
        # the torch plane's optimizers are torch ops: one of them compiles the store's
        # batch helpers; of the compiled plane's optimizers only SGD is warmed (see
        # _exercise_kernels)
        for i, opt in enumerate((SGD(lr=0.1),)):
            for mode, w in (("sum", None), ("mean", None), ("sum", torch.ones(6))):
                cfg = StoreConfig(path=f"{td}/s{i}{mode}{w is None}", device="cpu", device_rows=4, host_rows=8,
                                  optimizer=opt)
                with store_class(tables, cfg) as store:
                    store.plane = plane_named(plane)
                    out = store.lookup_bags(t, k, offsets, mode, w)
                    store.update_bags(t, k, offsets, torch.ones_like(out), mode, w)


def _child_env() -> dict:
    """The child's environment: this checkout's hiermem first on the path (not another
    install), and the flag that keeps its own import from warming up again."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, **{_CHILD: "1"})
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _start_child() -> subprocess.Popen | None:
    """A child process compiling the data plane's kernels (:func:`_exercise_kernels`);
    None on one core, or if it cannot start."""
    from .overlap import available_cores

    if available_cores() < 2:
        return None
    try:
        return subprocess.Popen([sys.executable, "-c", "from hiermem.store import warm; warm._exercise_kernels(0)"],
                                env=_child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


_LOCK = threading.RLock()  # one warm-up per process, whichever thread opens the first store
_WARMING = False  # set while this process warms: the stores it opens must not warm again


def ensure_compiled(force: bool = False, store_class=None) -> float:
    """Compile the kernels unless the cache holds them; returns the seconds it took.

    ``store_class`` (:class:`~hiermem.HierarchicalStore`) trains the tiny batches that
    compile what a store's steps call besides the kernels; without it, only the kernels
    compile now and the rest at a store's first step."""
    global _WARMING
    if jit.DISABLED or os.environ.get(_CHILD) or (jit.is_warm() and not force):
        return 0.0
    with _LOCK:
        if _WARMING or (jit.is_warm() and not force):  # re-entered, or another thread warmed it
            return 0.0
        _WARMING = True
        try:
            return _compile(store_class)
        finally:
            _WARMING = False


def _compile(store_class) -> float:
    print("hiermem: compiling the control plane's kernels once (cached for later runs) ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    child = _start_child()
    if child is None:
        _exercise()
        _exercise_kernels()
    else:  # the control plane, then what a store's batches compile besides (dedup,
        _exercise()  # checks: the torch plane) while the child compiles the data plane
        if store_class is not None:
            _exercise_dataplane(store_class, plane="torch")
        try:
            child.wait(timeout=900)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if store_class is not None:  # the compiled plane: loads what the child cached, compiles what it did not
        _exercise_dataplane(store_class)
        jit.mark_warm()
    return time.perf_counter() - t0
