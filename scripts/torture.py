"""Crash torture: SIGKILL a training process at random moments, reopen its store, check every row.

One store lives for the whole run.  Each *round* starts a fresh training process on it
(``--child``), kills it with SIGKILL, then reopens the store here and checks every row of
the universe (weights *and* optimizer state, bit for bit) against the reference log the
child kept:

* the child trains a bitwise-exact flat reference (:class:`Reference`) next to the store
  and checks every plain lookup against it (exit code 3 on the first difference);
* after each step, before the next call can write anything down, it appends the full
  records of every row the step changed to ``log.bin`` (one ``os.write`` per step), and
  after each *completed* ``flush()`` a FLUSH marker;
* reopening must succeed, and each row's record must be its last-flushed value (the value
  it held at the last FLUSH marker, or at the start of the round) or a later value it
  really held.  A row holding an older value than that is **lost**; a row holding a
  record it never held (say, weights of one step with the optimizer state of another) is
  **torn**.

Kill modes, cycled over the rounds (``MODES``):

* ``random``: after a random time of training;
* ``flush``: a moment after the child announces a flush (likely inside it);
* ``flush-txn`` / ``flush-sync`` / ``after-flush``: the child kills itself inside its
  k-th flush: with the rows put in the LMDB transaction but not committed; committed but
  not yet synced; or after ``flush()`` returned but before the marker was logged;
* ``writeback-txn``: inside its k-th eviction write-back transaction, before commit
  (write-backs are held and committed ``--write-combine`` records at a time, 0: each in
  its step; with ``--write-behind``, inside the writer thread's commit; with its I/O
  process, just after handing the batch to that process, which dies with the child,
  mid-commit);
* ``checkpoint``: a moment after the child announces a ``checkpoint()`` (its flush, the
  LMDB copy, the fsyncs or the rename);
* ``checkpoint-copy`` / ``checkpoint-rename``: inside the k-th checkpoint, after the LMDB
  copy into the temporary directory, or just before that directory is renamed into place.

* ``prefetch``: a moment after a prefetch starts on the ``PrefetchPipeline``'s thread;
* ``prefetch-writeback``: inside the write-back transaction of the k-th prefetch that
  evicts dirty rows;
* ``readers``: after a random time, while ``READERS`` read-only processes
  (``HierarchicalStore.open(path, readonly=True)``) read the store; they are killed too.
  Every record they read must be one the trainer held (else torn) and no older than the
  row's value at the flush their snapshot reported (else lost);
* ``restore``: the child checkpoints, trains ten more steps, closes the store and
  restores the checkpoint over it, dying inside ``restore()``: after its copy, after
  validating it, just after the data file is swapped, or in the open that follows.  The
  store must then hold the checkpoint exactly, or its state at the close.

After each kill the reopen must also have removed every temporary the kill left behind
(``.X.tmp-PID`` of a checkpoint, ``.X.restore-PID`` of a restore): the summary counts
those seen and those left (which must be none).

Every ~40 steps the child trains a few batches through ``CachedEmbeddingBagCollection``
and a ``PrefetchPipeline`` (depth 2), checking each forward against the reference.
The child takes a checkpoint every ~50 steps into a new directory, saving the
reference's state just before; after the kill every checkpoint directory of the round
must restore (``HierarchicalStore.restore``) to exactly that state, optimizer state and
step counts included, and a checkpoint cut short must not exist at all.

The values on disk after a round become the reference of the next one.  The last line
printed is ``kills=N lost=L torn=T`` (real counts); the exit status is 1 unless every
kill was a real SIGKILL, every reopen succeeded and no row was lost or torn.

    python scripts/torture.py --kills 100           # ~3-4 min on 2 busy cores
    python scripts/torture.py --kills 6 --seed 1 --dir /tmp/t --keep
    python scripts/torture.py --kills 100 --write-behind [--in-thread-io]
"""

from __future__ import annotations

import os as _os
# the checker compares every row bit for bit with a torch-op reference: the torch data plane
# (the compiled one equals it to ~1 ulp; see docs/dataplane.md)
_os.environ.setdefault("HIERMEM_DATA_PLANE", "torch")
import argparse
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from anywhere, test this checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hiermem as hm  # noqa: E402
from hiermem.store.rows import initial_records  # noqa: E402
from hiermem.tiers import DiskTier  # noqa: E402

# -- the store under torture ---------------------------------------------------------------
TABLES = [hm.TableSpec("bounded", 300, 8), hm.TableSpec("hashed", None, 4)]
HASHED = sorted({(i * 0x9E3779B97F4A7C15 + 12345) % (2**63) for i in range(119)} | {2**63 - 1})
SEED = 11
DEVICE_ROWS, HOST_ROWS = 8, 24  # 32 rows resident at most: constant evictions and write-backs
FLUSH_EVERY = 12  # steps between flushes, on average
MODES = ("random", "flush-txn", "flush", "flush-sync", "writeback-txn", "after-flush", "checkpoint",
         "checkpoint-copy", "checkpoint-rename", "prefetch", "prefetch-writeback", "readers", "restore")
INJECTED = {"flush-txn", "flush-sync", "writeback-txn", "after-flush", "checkpoint-copy", "checkpoint-rename",
            "prefetch-writeback", "restore"}
READERS = 2  # read-only processes running through a "readers" round
RESTORE_POINTS = ("copied", "validated", "replaced", "opening")  # where a "restore" round dies
PIPELINE_EVERY = 40  # steps between runs of PrefetchPipeline segments, on average
CHECKPOINT_EVERY = 50  # steps between checkpoints, on average
ROW, FLUSH = 0, 1  # log entry kinds


OPTIMIZERS = {  # Adagrad by default: per-element state, so weights and state could tear apart
    "adagrad": hm.Adagrad(lr=0.1), "adam": hm.Adam(lr=0.05), "rowwise_adagrad": hm.RowWiseAdagrad(lr=0.1),
    "sgd": hm.SGD(lr=0.1),
}
_OPTIMIZER = ["adagrad"]  # set by --optimizer, in the harness and (passed on) in the child
_WRITE_BEHIND = [False]  # set by --write-behind, likewise
_IO_PROCESS = [True]  # cleared by --in-thread-io, likewise
_WRITE_COMBINE = [None]  # set by --write-combine (None: the store's default), likewise


def optimizer() -> hm.Optimizer:
    return OPTIMIZERS[_OPTIMIZER[0]]


def pools() -> list[torch.Tensor]:
    """Every id of each table the torture touches (sorted int64)."""
    return [torch.arange(TABLES[0].num_rows), torch.tensor(HASHED, dtype=torch.int64)]


def widths(opt: hm.Optimizer) -> list[int]:
    return [s.dim + opt.state_width(s.dim) for s in TABLES]


def entry_dtype(width: int) -> np.dtype:
    """One log entry: sequence number, kind, table, position in the table's pool, record."""
    return np.dtype([("seq", "<i8"), ("kind", "<i4"), ("table", "<i4"), ("pos", "<i8"), ("rec", "<f4", (width,))])


def make_store(path: Path) -> hm.HierarchicalStore:
    cfg = hm.StoreConfig(path=path, device_rows=DEVICE_ROWS, host_rows=HOST_ROWS, optimizer=optimizer(), seed=SEED)
    return hm.HierarchicalStore(TABLES, cfg)


class Reference:
    """Every row of the universe as one dense record tensor per table, updated with the
    same ops as the store (so it is bitwise equal to it)."""

    def __init__(self, recs: list[torch.Tensor], steps: list[int]):
        self.opt = optimizer()
        self.pools = pools()
        self.recs = recs
        self.steps = list(steps)

    @classmethod
    def initial(cls) -> "Reference":
        opt = optimizer()
        recs = [initial_records(s, i, SEED, opt, p) for i, (s, p) in enumerate(zip(TABLES, pools()))]
        return cls(recs, [0] * len(TABLES))

    def pos(self, ti: int, ids: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.pools[ti], ids)

    def weights(self, ti: int, ids: torch.Tensor) -> torch.Tensor:
        return self.recs[ti][self.pos(ti, ids), :TABLES[ti].dim]

    def update(self, ti: int, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """As ``store.update``; returns the positions of the changed rows."""
        k, inv = torch.unique(ids, sorted=True, return_inverse=True)
        g = torch.zeros((k.numel(), TABLES[ti].dim)).index_add_(0, inv, grads)
        self.steps[ti] += 1
        p = self.pos(ti, k)
        rec = self.recs[ti].index_select(0, p)
        self.opt.apply(rec, g, TABLES[ti].dim, self.steps[ti])
        self.recs[ti].index_copy_(0, p, rec)
        return p

    def write(self, ti: int, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """As ``store.write`` of distinct ids (optimizer state reset)."""
        p = self.pos(ti, ids)
        self.recs[ti][p] = self.opt.state_init()
        self.recs[ti][p, :TABLES[ti].dim] = values
        return p

    def save(self, path: Path) -> None:
        np.savez(path, steps=np.array(self.steps, dtype=np.int64),
                 **{f"rec{i}": r.numpy() for i, r in enumerate(self.recs)})

    @classmethod
    def load(cls, path: Path) -> "Reference":
        with np.load(path, allow_pickle=False) as z:
            return cls([torch.from_numpy(z[f"rec{i}"].copy()) for i in range(len(TABLES))], z["steps"].tolist())


# -- the training process ------------------------------------------------------------------
class Log:
    """The child's append-only reference log (one ``os.write`` per step)."""

    def __init__(self, path: Path, width: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.dtype = entry_dtype(width)
        self.width = width
        self.seq = 0

    def rows(self, ti: int, pos: torch.Tensor, recs: torch.Tensor) -> None:
        e = np.zeros(pos.numel(), dtype=self.dtype)
        e["seq"], e["kind"], e["table"], e["pos"] = self.seq, ROW, ti, pos.numpy()
        e["rec"][:, :recs.shape[1]] = recs.numpy()
        self._write(e)

    def flush(self, flush_seq: int = -1) -> None:
        """A FLUSH marker; ``pos`` holds the store's flush number (what readers report)."""
        e = np.zeros(1, dtype=self.dtype)
        e["seq"], e["kind"], e["pos"] = self.seq, FLUSH, flush_seq
        self._write(e)

    def _write(self, e: np.ndarray) -> None:
        os.write(self.fd, e.tobytes())
        self.seq += 1


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(store: hm.HierarchicalStore, mode: str, nth: int) -> dict:
    """Make the child SIGKILL itself at ``mode``'s point of its ``nth`` flush (or eviction
    write-back).  Returns a dict whose ``"after_flush"`` is called when flush() returns."""
    disk, hooks = store.disk, {"after_flush": lambda: None, "in_checkpoint": [False]}
    seen = {"flush": 0, "writeback": 0, "prefetch": 0, "checkpoint": 0}
    real_write, real_txn, real_sync = disk.write, disk._write_txn, disk.sync
    wanted = {"writeback-txn": "writeback", "prefetch-writeback": "prefetch"}.get(mode, "flush")
    in_prefetch = [False]

    def write(groups, meta=None, sync=False):
        kind = ("checkpoint" if hooks["in_checkpoint"][0] else "flush") if sync else \
            "prefetch" if in_prefetch[0] else "writeback"
        seen[kind] += 1
        armed = seen[kind] == nth and kind == wanted

        def txn(body, nbytes=0):
            def dying_body(t):
                body(t)
                _die()  # the rows are in the transaction, which never commits
            dies = armed and mode in ("flush-txn", "writeback-txn", "prefetch-writeback")
            return real_txn(dying_body if dies else body, nbytes)

        def sync_():
            if armed and mode == "flush-sync":
                _die()  # committed, not yet synced
            return real_sync()
        disk._write_txn, disk.sync = txn, sync_
        try:
            return real_write(groups, meta=meta, sync=sync)
        finally:
            disk._write_txn, disk.sync = real_txn, real_sync

    if mode in INJECTED:
        disk.write = write
    if disk.write_behind and mode in ("writeback-txn", "prefetch-writeback"):
        # write-backs are queued; the k-th one dies inside its commit on the writer thread
        real_enqueue, real_prepare, real_body = disk.enqueue, disk._prepare, disk._txn_body
        doomed = []

        def enqueue(groups, meta=None):
            kind = "prefetch" if in_prefetch[0] else "writeback"
            seen[kind] += 1
            if seen[kind] == nth and kind == wanted:
                def prepare(g, m):
                    q = real_prepare(g, m)
                    doomed.append(q)
                    return q
                disk._prepare = prepare
            try:
                return real_enqueue(groups, meta=meta)
            finally:
                disk._prepare = real_prepare

        def txn_body(q):
            body = real_body(q)
            if not any(q is d for d in doomed):
                return body

            def dying_body(t):
                body(t)
                _die()  # the rows are in the transaction, which never commits
            return dying_body

        real_proc_write = disk._proc_write

        def proc_write(proc, q):  # io_process: the writer thread's I/O process commits
            if not any(q is d for d in doomed):
                return real_proc_write(proc, q)
            proc.begin_write(q.groups, q.meta_raw)
            _die()  # while the I/O process commits: it dies with this process, mid-commit
        disk.enqueue, disk._txn_body, disk._proc_write = enqueue, txn_body, proc_write
    if mode == "after-flush":
        hooks["after_flush"] = lambda: _die() if seen["flush"] == nth else None
    if mode.startswith("checkpoint-"):
        _checkpoint_kill_point(store, mode, nth)
    real_prefetch = store.prefetch

    def prefetch(tables, ids, *bags, **kw):  # runs on the pipeline's thread
        with store.lock:
            print("P", flush=True)
            in_prefetch[0] = True
            try:
                return real_prefetch(tables, ids, *bags, **kw)
            finally:
                in_prefetch[0] = False
                print("p", flush=True)
    store.prefetch = prefetch
    return hooks


def pipeline_segment(store: hm.HierarchicalStore, ref: "Reference", log: "Log", g: torch.Generator,
                     nbatches: int) -> bool:
    """Train ``nbatches`` batches through ``CachedEmbeddingBagCollection`` and a
    ``PrefetchPipeline`` (depth 2, prefetches on its own thread).  The module's fused
    backward calls ``store.update_bags``; the reference applies the same gradient and the
    changed rows are logged before the store lock is released, so no prefetch can write
    them down unlogged.  Returns False when a forward differs from the reference."""
    module = hm.CachedEmbeddingBagCollection(TABLES, store=store)
    real_update = store.update_bags

    def update_bags(tables, ids, offsets, grad, mode="sum", per_sample_weights=None, ticket=None, stepped=None,
                    samples=None, grad_owned=False):
        with store.lock:
            real_update(tables, ids, offsets, grad, mode, per_sample_weights, ticket=ticket, stepped=stepped,
                        samples=samples, grad_owned=grad_owned)
            if samples is not None:  # the collection's [B, T * D] layout: the bags' [T * B, D] for the reference
                D = store.max_dim
                grad = grad.reshape(samples, -1, D).transpose(0, 1).reshape(-1, D)
            lengths = torch.diff(offsets.cpu(), append=torch.tensor([ids.numel()]))
            g_ids = grad.detach().float().cpu()[torch.repeat_interleave(torch.arange(offsets.numel()), lengths)]
            present = torch.unique(tables).tolist()
            for ti in present:
                m = (tables == ti).cpu()
                pos = ref.update(ti, ids.cpu()[m], g_ids[m][:, :TABLES[ti].dim])
                log.rows(ti, pos, ref.recs[ti].index_select(0, pos))
            for ti in set(stepped or ()) - set(present):  # a step without ids (SparseAdam's count)
                ref.steps[ti] += 1
    store.update_bags = update_bags

    def batches():
        for _ in range(nbatches):
            lengths = torch.randint(0, 4, (2 * 4,), generator=g)  # 2 features x 4 samples
            parts = []
            for ti, n in enumerate(lengths.view(2, 4).sum(1).tolist()):
                pool = ref.pools[ti]
                parts.append(pool[(torch.rand(n, generator=g) ** 2 * pool.numel()).long()])
            yield hm.SparseFeatures(tuple(s.name for s in TABLES), torch.cat(parts), lengths)
    try:
        with hm.PrefetchPipeline(batches(), module, depth=2, timeout=60) as pipe:
            for f in pipe:
                out = module(f)
                if not torch.allclose(out, _pooled_reference(ref, f), atol=1e-5, rtol=1e-5):
                    return False
                (0.5 * out.square().sum()).backward()
    finally:
        store.update_bags = real_update
    return True


def _pooled_reference(ref: "Reference", f: hm.SparseFeatures) -> torch.Tensor:
    """What the module must output for ``f``: per sample, each table's bag summed."""
    cols, B = [], f.batch_size
    for ti, (vals, offs, _) in enumerate(f.to_dict().values()):
        bag = torch.repeat_interleave(torch.arange(B), torch.diff(offs, append=torch.tensor([vals.numel()])))
        cols.append(torch.zeros(B, TABLES[ti].dim).index_add_(0, bag, ref.weights(ti, vals)))
    return torch.cat(cols, 1)


class _EnvProxy:
    """The store's LMDB environment, with ``copy`` (the checkpoint's snapshot) wrapped."""

    def __init__(self, env, after_copy):
        self._env, self._after_copy = env, after_copy

    def copy(self, *a, **kw):
        out = self._env.copy(*a, **kw)
        self._after_copy()
        return out

    def __getattr__(self, name):
        return getattr(self._env, name)


def _checkpoint_kill_point(store: hm.HierarchicalStore, mode: str, nth: int) -> None:
    """Die in the ``nth`` checkpoint: right after LMDB's copy into the temporary directory
    (``checkpoint-copy``), or just before that directory is renamed into place
    (``checkpoint-rename``)."""
    seen = [0]

    def after_copy():
        seen[0] += 1
        if mode == "checkpoint-copy" and seen[0] == nth:
            _die()
    store._disk.env = _EnvProxy(store._disk.env, after_copy)
    real_rename = os.rename

    def rename(src, dst, *a, **kw):
        if mode == "checkpoint-rename" and seen[0] == nth and ".tmp-" in os.fspath(src):
            _die()
        return real_rename(src, dst, *a, **kw)
    os.rename = rename


def take_checkpoint(store, ref: "Reference", log: "Log", ckdir: Path, name: str, hooks: dict) -> None:
    """A checkpoint, with the reference snapshot it must hold saved first."""
    with open(ckdir / f"{name}.pending", "wb") as f:
        np.savez(f, steps=np.array(ref.steps, dtype=np.int64), **{f"rec{i}": r.numpy() for i, r in enumerate(ref.recs)})
    print("C", flush=True)
    hooks["in_checkpoint"][0] = True
    store.checkpoint(ckdir / name)
    hooks["in_checkpoint"][0] = False
    log.flush(store._flush_seq)
    os.replace(ckdir / f"{name}.pending", ckdir / f"{name}.npz")
    print("c", flush=True)


def restore_and_die(store, log: "Log", ck: Path, args: argparse.Namespace) -> None:
    """Close the store (a flush), then restore checkpoint ``ck`` over it and die inside the
    restore at ``RESTORE_POINTS[nth % 4]``: its copy made; the copy validated, before the
    data file is swapped in; just after the swap; in the open that follows."""
    import hiermem.store.checkpoint as ckm

    store.close()
    log.flush(store._flush_seq)
    point = RESTORE_POINTS[args.nth % len(RESTORE_POINTS)]
    print("R", flush=True)
    real_copy, real_replace = ckm.copy_store_files, os.replace

    def copy(src, dst):
        real_copy(src, dst)
        if point == "copied":
            _die()

    def replace(src, dst, *a, **kw):
        swap = os.fspath(src).endswith("data.mdb") and ".restore-" in os.fspath(src)
        if swap and point == "validated":
            _die()
        real_replace(src, dst, *a, **kw)
        if swap and point == "replaced":
            _die()
    ckm.copy_store_files, os.replace = copy, replace
    hm.HierarchicalStore.open = classmethod(lambda cls, *a, **kw: _die())  # "opening"
    hm.HierarchicalStore.restore(ck, args.store)
    _die()


def reader(args: argparse.Namespace) -> int:
    """Read random batches of both tables through a read-only handle until killed,
    logging each record read with the flush number of its snapshot (``--reader``)."""
    torch.set_num_threads(1)
    r = hm.HierarchicalStore.open(args.store, readonly=True)
    width = max(widths(r.optimizer))
    dt = reader_dtype(width)
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    rng = np.random.default_rng(args.nth)
    all_pools = pools()
    print("READY", flush=True)
    while True:
        ti = int(rng.integers(len(TABLES)))
        pos = rng.integers(0, all_pools[ti].numel(), 16)
        rec = r.records(TABLES[ti].name, all_pools[ti][torch.from_numpy(pos)]).numpy()
        e = np.zeros(len(pos), dtype=dt)
        e["flush"], e["table"], e["pos"] = r.flush_seq, ti, pos
        e["rec"][:, :rec.shape[1]] = rec
        os.write(fd, e.tobytes())
        time.sleep(0.002)


def reader_dtype(width: int) -> np.dtype:
    return np.dtype([("flush", "<i8"), ("table", "<i4"), ("pos", "<i8"), ("rec", "<f4", (width,))])


def child(args: argparse.Namespace) -> int:
    """Train on the store until killed: the ``--child`` entry point."""
    torch.set_num_threads(1)
    ref = Reference.load(Path(args.baseline))
    extra = {} if args.write_combine is None else {"write_combine": args.write_combine}
    store = hm.HierarchicalStore.open(args.store, policy=args.policy, write_behind=args.write_behind,
                                      io_process=not args.in_thread_io, **extra)
    if store._steps != ref.steps:
        print(f"MISMATCH steps {store._steps} != {ref.steps}", flush=True)
        return 3
    log = Log(Path(args.log), max(widths(ref.opt)))
    hooks = install_kill_point(store, args.mode, args.nth)
    g = torch.Generator().manual_seed(args.seed)
    ckdir, nck = Path(args.ckdir), 0
    restore_at = int(torch.randint(10, 60, (1,), generator=g)) if args.mode == "restore" else -1
    print("READY", flush=True)
    for step in range(args.max_steps):
        if step == restore_at:  # the checkpoint a "restore" round restores, ten steps on
            nck += 1
            (ckdir / f"{args.round}-restore.txt").write_text(f"{args.round}-{nck}")
            take_checkpoint(store, ref, log, ckdir, f"{args.round}-{nck}", hooks)
            continue
        if restore_at >= 0 and step == restore_at + 10:
            restore_and_die(store, log, ckdir / (ckdir / f"{args.round}-restore.txt").read_text(), args)
        if int(torch.randint(0, CHECKPOINT_EVERY, (1,), generator=g)) == 0:
            nck += 1
            name = f"{args.round}-{nck}"
            with open(ckdir / f"{name}.pending", "wb") as f:  # what the checkpoint must hold
                np.savez(f, steps=np.array(ref.steps, dtype=np.int64),
                         **{f"rec{i}": r.numpy() for i, r in enumerate(ref.recs)})
            print("C", flush=True)
            hooks["in_checkpoint"][0] = True  # its flush is not one of the flushes counted for kill points
            store.checkpoint(ckdir / name)
            hooks["in_checkpoint"][0] = False
            log.flush(store._flush_seq)  # a checkpoint flushes first
            os.replace(ckdir / f"{name}.pending", ckdir / f"{name}.npz")
            print("c", flush=True)
            continue
        if int(torch.randint(0, PIPELINE_EVERY, (1,), generator=g)) == 0:
            if not pipeline_segment(store, ref, log, g, int(torch.randint(5, 25, (1,), generator=g))):
                print(f"MISMATCH pipeline forward step {step}", flush=True)
                return 3
            continue
        op = int(torch.randint(0, 100, (1,), generator=g))
        if op < 100 // FLUSH_EVERY:
            print("F", flush=True)
            store.flush()
            hooks["after_flush"]()
            log.flush(store._flush_seq)
            print("f", flush=True)
            continue
        ti = int(torch.randint(0, len(TABLES), (1,), generator=g))
        pool, dim = ref.pools[ti], TABLES[ti].dim
        n = int(torch.randint(1, 17, (1,), generator=g))
        ids = pool[(torch.rand(n, generator=g) ** 2 * pool.numel()).long()]  # skewed, duplicates
        if op < 25:  # lookup only: promotions, evictions, write-backs
            if not torch.equal(store.lookup(TABLES[ti].name, ids), ref.weights(ti, ids)):
                print(f"MISMATCH lookup step {step}", flush=True)
                return 3
            continue
        if op < 40:  # import rows (distinct ids)
            ids = torch.unique(ids)
            vals = torch.randn(ids.numel(), dim, generator=g)
            store.write(TABLES[ti].name, ids, vals)
            pos = ref.write(ti, ids, vals)
        elif op < 55:  # pooled training step
            offsets = torch.unique(torch.cat((torch.tensor([0]), torch.randint(0, n, (3,), generator=g))))
            pooled = store.lookup_pooled(TABLES[ti].name, ids, offsets)
            grad_out = 0.5 * pooled + torch.randn(pooled.shape, generator=g)
            store.update_pooled(TABLES[ti].name, ids, offsets, grad_out)
            lengths = torch.diff(offsets, append=torch.tensor([n]))
            bag = torch.repeat_interleave(torch.arange(offsets.numel()), lengths)
            pos = ref.update(ti, ids, grad_out.index_select(0, bag))
        else:  # lookup + update with gradients that depend on the values
            emb = store.lookup(TABLES[ti].name, ids)
            if not torch.equal(emb, ref.weights(ti, ids)):
                print(f"MISMATCH train step {step}", flush=True)
                return 3
            grads = 0.5 * emb + torch.randn(emb.shape, generator=g)
            store.update(TABLES[ti].name, ids, grads)
            pos = ref.update(ti, ids, grads)
        log.rows(ti, pos, ref.recs[ti].index_select(0, pos))  # before any later call can write them
    print("IDLE", flush=True)  # the kill point never came: die anyway (counted as missed)
    if args.mode in INJECTED:
        _die()
    time.sleep(3600)
    return 0


# -- the harness ---------------------------------------------------------------------------
@dataclass
class Check:
    """One reopen's verdict, counted in rows."""

    rows: int = 0
    lost: int = 0
    torn: int = 0
    later: int = 0  # rows holding a value newer than their last-flushed one
    checkpoints: int = 0  # checkpoints of the round restored and compared
    checkpoint_bad: int = 0  # of those, unrestorable or not exactly their snapshot
    stale_tmp: int = 0  # temporaries (checkpoint, restore) a kill left behind, seen before the reopen
    stale_tmp_left: int = 0  # ... and still there after the reopen and the checkpoint checks
    restored: bool = False  # a "restore" round: the store held the checkpoint after the kill
    reader_rows: int = 0  # records read by read-only processes during the round, checked
    reader_torn: int = 0  # ... that the trainer never held
    reader_stale: int = 0  # ... older than the flush their snapshot reported
    problems: list[str] = field(default_factory=list)


def read_log(path: Path, width: int) -> np.ndarray:
    """The log's complete entries (a kill may cut the last ``os.write``)."""
    raw = path.read_bytes() if path.exists() else b""
    dt = entry_dtype(width)
    return np.frombuffer(raw[:len(raw) - len(raw) % dt.itemsize], dtype=dt)


def on_disk(path: Path, opt: hm.Optimizer) -> tuple[list[np.ndarray], list[int]]:
    """Every universe row's record as the (closed) store holds it, read straight from
    LMDB (rows never written: the initialiser's), and the per-table step counts."""
    disk = DiskTier(path, create=False)
    try:
        meta = disk.read_meta()
        recs = []
        for ti, (spec, pool) in enumerate(zip(TABLES, pools())):
            found, rec = disk.read(ti, pool.numpy(), widths(opt)[ti])
            init = initial_records(spec, ti, SEED, opt, pool).numpy()
            recs.append(np.where(found[:, None], rec, init))
    finally:
        disk.close()
    return recs, [int(meta["steps"][s.name]) for s in TABLES]


def verify(path: Path, log: np.ndarray, base: Reference) -> tuple[Check, Reference]:
    """Reopen the store, check every row against the log; returns the verdict and the
    store's state as the next round's reference."""
    c = Check()
    opt = base.opt
    store = hm.HierarchicalStore.open(path)  # must not raise
    try:
        served = []
        for ti, pool in enumerate(pools()):
            chunk = DEVICE_ROWS + HOST_ROWS
            served.append(torch.cat([store.lookup(TABLES[ti].name, pool[i:i + chunk])
                                     for i in range(0, pool.numel(), chunk)]).numpy())
    finally:
        store.close()
    recs, steps = on_disk(path, opt)
    flushes = log["seq"][log["kind"] == FLUSH]
    last_flush = int(flushes.max()) if flushes.size else -1
    rows = log[log["kind"] == ROW]
    for ti, spec in enumerate(TABLES):
        w, have = widths(opt)[ti], recs[ti]
        if not np.array_equal(served[ti].view(np.uint32), have[:, :spec.dim].view(np.uint32)):
            c.problems.append(f"{spec.name}: lookups after reopen differ from the records in LMDB")
        e = rows[rows["table"] == ti]
        n = have.shape[0]
        # the seq of each row's last-flushed value (-1: its value at the start of the round)
        flushed_at = np.full(n, -1, dtype=np.int64)
        before = e[e["seq"] < last_flush]
        np.maximum.at(flushed_at, before["pos"], before["seq"])
        # the newest seq whose logged value the row holds now (-1: the start value, -2: none)
        match = np.full(n, -2, dtype=np.int64)
        start = base.recs[ti].numpy()
        match[np.all(have.view(np.uint32) == start.view(np.uint32), axis=1)] = -1
        same = np.all(e["rec"][:, :w].view(np.uint32) == have[e["pos"]].view(np.uint32), axis=1)
        np.maximum.at(match, e["pos"][same], e["seq"][same])
        torn, lost = match == -2, (match >= -1) & (match < flushed_at)
        c.rows += n
        c.torn += int(torn.sum())
        c.lost += int(lost.sum())
        c.later += int((match > flushed_at).sum())
        for kind, m in (("torn", torn), ("lost", lost)):
            for p in np.nonzero(m)[0][:3].tolist():
                c.problems.append(f"{kind}: {spec.name} id {int(pools()[ti][p])}")
    return c, Reference([torch.from_numpy(r.copy()) for r in recs], steps)


@dataclass
class Round:
    mode: str
    rc: int
    in_flush: bool  # the child announced a flush it never finished
    check: Check
    open_error: str | None = None
    in_checkpoint: bool = False  # ... or a checkpoint
    in_prefetch: bool = False  # ... or a prefetch (on the pipeline's thread)
    missed: bool = False  # an injected kill point never came (the child died idle)


class _Output:
    """The child's stdout, drained by a thread (a full pipe would block the child's
    prints, and so the child, while the harness waits for it to die)."""

    def __init__(self, proc: subprocess.Popen):
        self.q: queue.Queue = queue.Queue()
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._drain, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _drain(self, f) -> None:
        for line in f:
            self.q.put(line.strip())
        self.q.put(None)  # EOF

    def _next(self, timeout: float) -> str | None:
        line = self.q.get(timeout=max(0.0, timeout))
        if line is not None:
            self.lines.append(line)
        return line

    def wait_for(self, word: str, count: int, timeout: float) -> None:
        """Until the child printed ``word`` ``count`` more times."""
        seen, deadline = 0, time.monotonic() + timeout
        while seen < count:
            try:
                line = self._next(deadline - time.monotonic())
            except queue.Empty:
                raise TimeoutError(f"child did not print {word!r} x{count} in {timeout}s") from None
            if line is None:
                raise RuntimeError(f"child exited early: {self.lines[-5:]}")
            seen += line == word

    def rest(self, timeout: float = 60) -> list[str]:
        """Every line, once the child is dead."""
        self.thread.join(timeout)
        while True:
            try:
                if self._next(0) is None:
                    break
            except queue.Empty:
                break
        return self.lines


def one_round(work: Path, i: int, mode: str, rng: random.Random, base: Reference, policy: str) -> tuple[Round, Reference]:
    base_path, log_path = work / "baseline.npz", work / f"log{i}.bin"
    base.save(base_path)
    nth = rng.randint(1, 4)
    (work / "ck").mkdir(exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--optimizer", _OPTIMIZER[0],
           "--store", str(work / "store"), "--ckdir", str(work / "ck"), "--round", str(i),
           "--log", str(log_path), "--baseline", str(base_path), "--seed", str(rng.randrange(2**31)),
           "--mode", mode, "--nth", str(nth), "--policy", policy] + (["--write-behind"] if _WRITE_BEHIND[0] else []) \
        + ([] if _IO_PROCESS[0] else ["--in-thread-io"]) \
        + ([] if _WRITE_COMBINE[0] is None else ["--write-combine", str(_WRITE_COMBINE[0])])
    with open(work / "child.stderr", "w+") as err:
        readers = start_readers(work, i, rng) if mode == "readers" else []
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
        out = _Output(proc)
        try:
            out.wait_for("READY", 1, 120)
            if mode in ("random", "readers"):
                time.sleep(rng.uniform(0.05, 0.8))
            elif mode == "flush":
                out.wait_for("F", nth, 120)
                time.sleep(rng.uniform(0, 0.002))
            elif mode == "checkpoint":
                out.wait_for("C", nth, 120)
                time.sleep(rng.uniform(0, 0.01))
            elif mode == "prefetch":
                out.wait_for("P", 5 * nth, 120)
                time.sleep(rng.uniform(0, 0.002))
            if mode not in INJECTED:
                os.kill(proc.pid, signal.SIGKILL)
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for r in readers:  # killed too: a reader's death must not matter either
                r.kill()
                r.wait()
                r.stdout.close()
        lines = out.rest()
        proc.stdout.close()
        err.seek(0)
        if any(o.startswith("MISMATCH") for o in lines) or rc != -signal.SIGKILL:
            raise RuntimeError(f"round {i} ({mode}): child rc={rc}, {[o for o in lines if len(o) > 1]}\n"
                               f"{err.read()[-3000:]}")
    out = lines
    marks = [o for o in out if o in ("F", "f")]
    in_flush = bool(marks) and marks[-1] == "F"
    cmarks = [o for o in out if o in ("C", "c")]
    in_checkpoint = bool(cmarks) and cmarks[-1] == "C"
    pmarks = [o for o in out if o in ("P", "p")]
    in_prefetch = bool(pmarks) and pmarks[-1] == "P"
    log = read_log(log_path, max(widths(base.opt)))
    stale = count_temporaries(work)
    try:
        if mode == "restore":
            check, nxt = verify_restore(work, i, log, base)
        else:
            check, nxt = verify(work / "store", log, base)
    except hm.HierMemError as e:
        return Round(mode, rc, in_flush, Check(), open_error=f"{type(e).__name__}: {e}"), base
    check.stale_tmp = stale
    if mode == "readers":
        verify_readers(work, i, log, base, check)
    verify_checkpoints(work, i, check)
    check.stale_tmp_left = count_temporaries(work)
    if check.stale_tmp_left:
        check.problems.append(f"{check.stale_tmp_left} stale temporaries left after the reopen")
    return Round(mode, rc, in_flush, check, in_checkpoint=in_checkpoint, in_prefetch=in_prefetch,
                 missed="IDLE" in out), nxt


def count_temporaries(work: Path) -> int:
    """Checkpoint and restore temporaries (``.X.tmp-PID``, ``.X.restore-PID``) in the work
    and checkpoint directories."""
    return sum(1 for d in (work, work / "ck") if d.is_dir() for p in d.iterdir()
               if p.name.startswith(".") and (".tmp-" in p.name or ".restore-" in p.name))


def start_readers(work: Path, i: int, rng: random.Random) -> list[subprocess.Popen]:
    """``READERS`` read-only processes on the store, each logging what it reads."""
    procs = []
    for k in range(READERS):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--reader", "--optimizer", _OPTIMIZER[0],
               "--store", str(work / "store"), "--log", str(work / f"rlog{i}-{k}.bin"), "--nth",
               str(rng.randrange(2**31))]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    for p in procs:
        if p.stdout.readline().strip() != "READY":
            raise RuntimeError(f"round {i}: a reader did not start")
    return procs


def _hash_rows(rec: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row's bits."""
    u = np.ascontiguousarray(rec, dtype=np.float32).view(np.uint32).astype(np.uint64)
    mult = np.random.default_rng(7).integers(1, 2**63, size=u.shape[1], dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        return (u * mult).sum(1, dtype=np.uint64)


def verify_readers(work: Path, i: int, log: np.ndarray, base: Reference, c: Check) -> None:
    """Every record a reader read in round ``i`` must be one the trainer held (its value at
    the round's start or a logged one; else torn), and no older than the row's value at
    the flush the reader's snapshot reported, when that flush is in the round's log
    (else stale)."""
    rows = log[log["kind"] == ROW]
    marks = log[log["kind"] == FLUSH]
    for f in sorted(work.glob(f"rlog{i}-*.bin")):
        raw = f.read_bytes()
        dt = reader_dtype(max(widths(base.opt)))
        obs = np.frombuffer(raw[:len(raw) - len(raw) % dt.itemsize], dtype=dt)
        for ti in range(len(TABLES)):
            w = widths(base.opt)[ti]
            o = obs[obs["table"] == ti]
            if not o.size:
                continue
            e = rows[rows["table"] == ti]
            oh = _hash_rows(o["rec"][:, :w])
            start = _hash_rows(base.recs[ti].numpy())
            eh = _hash_rows(e["rec"][:, :w]) if e.size else np.zeros(0, np.uint64)
            for pos, h, fl in zip(o["pos"].tolist(), oh.tolist(), o["flush"].tolist()):
                c.reader_rows += 1
                held = e["seq"][(e["pos"] == pos) & (eh == h)]
                at_start = start[pos] == h
                if not held.size and not at_start:
                    c.reader_torn += 1
                    if c.reader_torn <= 3:
                        c.problems.append(f"reader torn: {TABLES[ti].name} pos {pos} flush {fl}")
                    continue
                m = marks["seq"][marks["pos"] == fl]
                if not m.size:  # that flush is not in this round's log: nothing more to check
                    continue
                before = e["seq"][(e["pos"] == pos) & (e["seq"] < m[0])]
                need = int(before.max()) if before.size else -1
                got = int(held.max()) if held.size else -1
                if got < need:
                    c.reader_stale += 1
                    if c.reader_stale <= 3:
                        c.problems.append(f"reader stale: {TABLES[ti].name} pos {pos} flush {fl}")
    c.torn += c.reader_torn
    c.lost += c.reader_stale


def verify_restore(work: Path, i: int, log: np.ndarray, base: Reference) -> tuple[Check, Reference]:
    """After a kill inside ``restore()``: the store holds either the checkpoint exactly (the
    swap happened) or its state at the close before the restore (checked as any round)."""
    ck = work / "ck"
    name = (ck / f"{i}-restore.txt").read_text()
    want = Reference.load(ck / f"{name}.npz")
    recs, steps = on_disk(work / "store", want.opt)
    if steps == want.steps and all(np.array_equal(r.view(np.uint32), w.numpy().view(np.uint32))
                                   for r, w in zip(recs, want.recs)):
        hm.HierarchicalStore.open(work / "store").close()  # must open (and clear what the kill left)
        c = Check(rows=sum(r.shape[0] for r in recs), restored=True)
        return c, Reference([torch.from_numpy(r.copy()) for r in recs], steps)
    return verify(work / "store", log, base)


def verify_checkpoints(work: Path, i: int, c: Check) -> None:
    """Restore every checkpoint directory the round's process made and compare it, bit for
    bit, with the reference snapshot the process saved just before taking it."""
    ck = work / "ck"
    for d in sorted(p for p in ck.glob(f"{i}-*") if p.is_dir()):
        want_path = next((p for p in (ck / f"{d.name}.npz", ck / f"{d.name}.pending") if p.exists()), None)
        c.checkpoints += 1
        try:
            want = Reference.load(want_path)
            hm.HierarchicalStore.restore(d, work / "restored").close()
            recs, steps = on_disk(work / "restored", want.opt)
        except (hm.HierMemError, OSError, ValueError) as e:
            c.checkpoint_bad += 1
            c.problems.append(f"checkpoint {d.name}: {type(e).__name__}: {e}")
            continue
        same = steps == want.steps and all(np.array_equal(r.view(np.uint32), w.numpy().view(np.uint32))
                                           for r, w in zip(recs, want.recs))
        if not same:
            c.checkpoint_bad += 1
            c.problems.append(f"checkpoint {d.name}: restored rows differ from its snapshot")


def torture(kills: int, work: Path, seed: int = 0, modes: tuple[str, ...] = MODES,
            verbose: bool = True, opt: str = "adagrad", write_behind: bool = False,
            io_process: bool = True, write_combine: int | None = None) -> list[Round]:
    """Run ``kills`` rounds on a fresh store under ``work`` (optimizer ``opt``, a key of
    :data:`OPTIMIZERS`; ``write_behind`` for the child's store); returns each round's result."""
    _OPTIMIZER[0] = opt
    _WRITE_BEHIND[0] = write_behind
    _IO_PROCESS[0] = io_process
    _WRITE_COMBINE[0] = write_combine
    rng = random.Random(seed)
    make_store(work / "store").close()
    base = Reference.initial()
    rounds = []
    for i in range(kills):
        mode = modes[i % len(modes)]
        r, base = one_round(work, i, mode, rng, base, policy=("lru", "lfu")[(i // len(modes)) % 2])
        rounds.append(r)
        if r.open_error:  # the next round would start from a reference the store no longer holds
            raise RuntimeError(f"round {i} ({mode}): the store did not reopen after the kill: {r.open_error}")
        if verbose:
            c = r.check
            print(f"kill {i + 1:3d} {mode:18s} in_flush={int(r.in_flush)} in_ckpt={int(r.in_checkpoint)} "
                  f"in_prefetch={int(r.in_prefetch)} "
                  f"rows={c.rows} later={c.later} lost={c.lost} torn={c.torn} ckpts={c.checkpoints} "
                  f"ckpt_bad={c.checkpoint_bad} tmp={c.stale_tmp}/{c.stale_tmp_left}"
                  + (f" reader_rows={c.reader_rows}" if mode == "readers" else "")
                  + (f" restored={int(c.restored)}" if mode == "restore" else "")
                  + (f" OPEN ERROR {r.open_error}" if r.open_error else "")
                  + "".join(f"\n    {p}" for p in c.problems), flush=True)
    return rounds


def summary(rounds: list[Round]) -> dict:
    return {"kills": sum(r.rc == -signal.SIGKILL for r in rounds),
            "lost": sum(r.check.lost for r in rounds), "torn": sum(r.check.torn for r in rounds),
            "open_errors": sum(r.open_error is not None for r in rounds),
            "problems": sum(len(r.check.problems) for r in rounds),
            "in_flush": sum(r.in_flush for r in rounds), "rows_checked": sum(r.check.rows for r in rounds),
            "in_checkpoint": sum(r.in_checkpoint for r in rounds),
            "in_prefetch": sum(r.in_prefetch for r in rounds),
            "missed_kill_points": sum(r.missed for r in rounds),
            "checkpoints_restored": sum(r.check.checkpoints for r in rounds),
            "checkpoints_bad": sum(r.check.checkpoint_bad for r in rounds),
            "stale_temporaries_seen": sum(r.check.stale_tmp for r in rounds),
            "stale_temporaries_left": sum(r.check.stale_tmp_left for r in rounds),
            "restores_killed": sum(r.mode == "restore" for r in rounds),
            "restores_completed": sum(r.check.restored for r in rounds),
            "reader_rows_checked": sum(r.check.reader_rows for r in rounds),
            "reader_torn": sum(r.check.reader_torn for r in rounds),
            "reader_stale": sum(r.check.reader_stale for r in rounds),
            "rows_later": sum(r.check.later for r in rounds),
            "modes": {m: sum(r.mode == m for r in rounds) for m in dict.fromkeys(r.mode for r in rounds)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    p.add_argument("--in-thread-io", action="store_true",
                   help="the child's store does its background LMDB I/O on its threads (io_process=False)")
    p.add_argument("--write-behind", action="store_true",
                   help="the child's store commits eviction write-backs on its writer thread")
    p.add_argument("--write-combine", type=int, default=24, metavar="ROWS",
                   help="the child's store holds write-backs until ROWS records, then commits them together "
                        "(0: commits each); default 24, so that the write-back kill points come often in "
                        "these small tiers (the store's own default, 16384, would hold most rows till a flush)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    for a in ("--store", "--log", "--baseline", "--mode", "--policy", "--ckdir", "--round"):
        p.add_argument(a, help=argparse.SUPPRESS)
    p.add_argument("--nth", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=20_000, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    _WRITE_BEHIND[0] = a.write_behind
    _IO_PROCESS[0] = not a.in_thread_io
    _WRITE_COMBINE[0] = a.write_combine
    if a.child:
        _OPTIMIZER[0] = a.optimizer
        return child(a)
    if a.reader:
        _OPTIMIZER[0] = a.optimizer
        return reader(a)
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="hm-torture-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rounds = torture(a.kills, work, a.seed, opt=a.optimizer, write_behind=a.write_behind,
                         io_process=not a.in_thread_io, write_combine=a.write_combine)
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    s = summary(rounds)
    print(json.dumps(s))
    print(f"kills={s['kills']} lost={s['lost']} torn={s['torn']}")
    ok = s["kills"] == a.kills and s["lost"] == s["torn"] == s["open_errors"] == s["problems"] == 0 \
        and s["checkpoints_bad"] == 0 and s["stale_temporaries_left"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
