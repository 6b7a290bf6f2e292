"""PrefetchPipeline: read a data loader ahead and bring upcoming batches' rows up the hierarchy.

With depth ``k`` the store sees, in this order (:func:`hiermem.store.multi.prefetch_order`,
which the simulator replays; the rule :func:`~hiermem.store.multi.prefetch_now` is the one
both follow): ``P(0) .. P(k-1)``, then per step ``i``: ``L(i)``, ``P(i+k)``, ``U(i)``,
``R(i)`` — prefetch-and-pin, lookup, fused update, unpin (``P(i+k)`` after ``R(i)`` when
batch ``i`` was not pinned).  ``P(i+k)`` runs on a background thread
while step ``i`` computes its dense layers (on a side CUDA stream when the device is a
GPU; the host tier is pinned memory then), and ``L(i+1)`` waits for the thread to be
idle, so every store operation happens in one fixed order and a run is deterministic
whatever the thread timing.  Pins keep an in-flight batch's rows resident, so a later
prefetch can never evict them; a batch that does not fit on the device beside the
pinned rows pins nothing and is looked up normally: a smaller effective depth, counted,
never an error or a deadlock.

As soon as a batch is read from the loader (``depth + 2`` batches ahead), a second
thread reads its non-resident rows from LMDB outside the store's lock
(:meth:`~hiermem.HierarchicalStore.read_ahead`; through an I/O process with
``StoreConfig(io_process=True)``, so the read does not hold the GIL), overlapping the
steps before it; its
prefetch (or lookup) then places them from the disk tier's cache.  A read-ahead changes
nothing but speed (a record written since is dropped), so that thread needs no place in
the fixed order above.

On the threads, the training thread's share of a step is small (see
``critical_path_seconds``): the lookup tensors are formed on the read-ahead thread, the
lookup pools from the slots its prefetch pinned, with its bags validated there, and a
release runs inline when the prefetch thread is idle.  While a threaded pipeline is open
the switch interval is ``gil_slice`` (0.2 ms), and the threads run at a lower priority
(:mod:`hiermem.tiers.priority`), so the background work waits for the step, not the
reverse.

Where nothing can overlap the background work (no GPU, no core free beside torch's
intra-op threads), ``background="auto"`` runs the pipeline in ``"foreground"`` mode: no
prefetch and no read-ahead, each lookup places its own rows (see
:func:`choose_background`).  Where something could overlap, ``"auto"`` starts the
threads but measures whether they make the loop faster: a trial times the steps in
alternating windows with and without them and keeps them only where they win (see
``ADAPT_*``).  A small device tier, many small tables or a step bound by Python (a GPU
step is launches and glue) can make the second placement pass, the pins and the
threads' share of the GIL cost more than the reads they hide: measured on an H200 host,
0.78x of no prefetch on the Criteo-shaped workload before this trial existed.

Thread-safety: the loader is iterated on the caller's thread; only store calls run on
the background threads, under the store's lock (but for the read-ahead's LMDB read).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ..store.multi import Ticket, prefetch_now
from ..errors import HierMemError, InvalidArgumentError
from .features import SparseFeatures
from ..store.overlap import can_overlap
from ..tiers.priority import lower_this_thread
from ..observe.stats import IO


def find_features(batch: Any) -> Any:
    """The :class:`SparseFeatures` (or KJT) in a batch: the batch itself, or an element
    of a tuple/list, or a value of a dict."""
    if isinstance(batch, SparseFeatures) or _is_kjt(batch):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for x in items:
        if isinstance(x, SparseFeatures) or _is_kjt(x):
            return x
    raise InvalidArgumentError(f"no SparseFeatures in the batch ({type(batch).__name__}); pass features=")


def _is_kjt(x: Any) -> bool:
    return type(x).__name__ == "KeyedJaggedTensor"


def _per_thread_intra_op() -> bool:
    """Whether ``torch.set_num_threads`` sets the calling thread's count (OpenMP) rather
    than one pool's for all threads."""
    global _PER_THREAD
    if _PER_THREAD is None:
        _PER_THREAD = "OpenMP" in torch.__config__.parallel_info()
    return _PER_THREAD


_PER_THREAD: bool | None = None


MODES = ("threads", "inline", "foreground")

# "auto" where background work could overlap: measured, not assumed.  A trial times
# steps (one __next__ to the next: the whole loop body) in alternating windows with
# prefetch threads and without prefetch (ABAB), each window ADAPT_STEPS steps after the
# steps a switch disturbs, and keeps threads only when they are ADAPT_MARGIN faster;
# the first trial starts after ADAPT_AFTER steps, then one every ADAPT_EVERY steps.
ADAPT_AFTER = 20
ADAPT_STEPS = 8
ADAPT_WINDOWS = 4
ADAPT_MARGIN = 0.98
ADAPT_EVERY = 2000


def choose_background(background: bool | str, device: torch.device, lookahead: bool = False) -> tuple[str, str]:
    """How the pipeline runs its store jobs, and why: ``"threads"`` (prefetch and
    read-ahead on background threads), ``"inline"`` (the same jobs in the same order on
    the training thread: same placements and counters, no overlap) or ``"foreground"``
    (no prefetch and no read-ahead: each step's lookup places its own rows).

    ``background=True``/``False`` ask for threads/inline.  ``"auto"`` (the default;
    ``HIERMEM_BACKGROUND=threads|inline|foreground`` overrides it) decides from the
    machine (:func:`hiermem.store.overlap.can_overlap`): threads where they can overlap the step
    (a GPU, or a core free beside torch's intra-op threads); otherwise foreground, since
    prefetching on the training thread only repeats the lookup's dedup and placement
    (measured in ``scripts/bench_train.py`` on 2 cores: 0.93x of no prefetch inline,
    0.69x on threads) — but inline for a lookahead policy, which learns the coming
    batches' rows only through the pipeline."""
    if background == "auto":
        env = os.environ.get("HIERMEM_BACKGROUND", "auto").strip().lower()
        if env in MODES:
            return env, f"HIERMEM_BACKGROUND={env}"
        on, why = can_overlap(device)
        if on:
            return "threads", why
        if lookahead:
            return "inline", f"{why}: inline, for the lookahead policy's view of the coming batches"
        return "foreground", f"{why}: no prefetch, each lookup places its own rows"
    if isinstance(background, bool):
        return ("threads" if background else "inline"), "asked for"
    raise InvalidArgumentError(f"background must be True, False or 'auto', got {background!r}")


#: The interpreter's switch interval while a pipeline's threads run (seconds; the default
#: is 5 ms).  A thread waiting for the GIL asks its holder to drop it only after this
#: long, so with the default the training thread, coming back from a GIL-free op (a CUDA
#: sync, the dense part) while the prefetch thread runs Python, can wait up to 5 ms for
#: its next line; with 0.2 ms it waits at most that.  Set back when the last pipeline closes.
GIL_SLICE = 2e-4
_slice_lock = threading.Lock()
_slice_users = 0
_slice_saved: tuple[float, float] | None = None  # (the interval before, the one set)


def _slice_begin(seconds: float | None) -> bool:
    """Shorten the switch interval to ``seconds`` (None: leave it); whether it counts a user."""
    global _slice_users, _slice_saved
    if seconds is None:
        return False
    with _slice_lock:
        if _slice_users == 0:
            before = sys.getswitchinterval()
            if seconds < before:
                sys.setswitchinterval(seconds)
                _slice_saved = (before, sys.getswitchinterval())
            else:
                _slice_saved = None
        _slice_users += 1
    return True


def _slice_end() -> None:
    """One user fewer; the last one puts the interval back (unless someone changed it since)."""
    global _slice_users, _slice_saved
    with _slice_lock:
        _slice_users -= 1
        if _slice_users == 0 and _slice_saved is not None:
            before, ours = _slice_saved
            if sys.getswitchinterval() == ours:
                sys.setswitchinterval(before)
            _slice_saved = None


class _Gate:
    """Background jobs start only while the training thread is outside hiermem.

    Python threads share one GIL, and every torch op or GIL-free kernel on the training
    thread lets a waiting background thread take it: measured on the host-backed
    configuration of ``scripts/bench_pipeline.py``, the forward's reshape (three view ops,
    10 us alone) took 0.13 ms a step, and its anchor tensor 0.03 ms.  So the training
    thread closes the gate while it runs its share of a step (taking a batch, the
    lookup, the fused update): a job submitted meanwhile is queued when it opens (so no
    thread even wakes, which would take the GIL to return from its queue's wait), a job
    queued before waits at its start until it opens, and a job already running goes on.
    Taking a batch parks it (:meth:`park`): closed until that batch's forward leaves,
    since on a training loop the forward follows at once.  The training thread opens it
    whenever it waits for the background threads (:meth:`_Worker.wait_idle`), so
    nothing can wait for a job that waits for the gate.  The background work then runs
    beside the step's dense part (on a GPU host: while the training thread waits for the
    device, without the GIL).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._closed = False
        self._parked = False  # closed by a batch's taking, until that batch's forward
        self.owner: int | None = None  # the thread that closed it
        self._held: list = []  # (queue, job) submitted while closed, in order

    def close(self, take_over: bool = False) -> bool:
        """Close it (from the training thread); False when it was closed already (a
        nested entry: only the outer one opens it).  A parked gate is taken over by the
        forward (``take_over``: it stays closed, and the forward opens it); anyone else
        opens it first, so what was held while parked starts (a batch taken and never
        looked up holds nothing for longer than the next entry)."""
        if self._parked:
            if take_over and self.owner == threading.get_ident():
                self._parked = False
                return True
            self.open()
        if self._closed:
            return False
        self._closed = True
        self.owner = threading.get_ident()
        return True

    def park(self) -> None:
        """Leave it closed past the caller's exit (taking a batch): the batch's forward
        follows at once on a training loop, and the jobs submitted meanwhile (the
        read-ahead of a later batch) would otherwise wake and take the GIL beside it.
        The forward, the next entry or any wait for the background threads opens it."""
        self._parked = True

    def open(self) -> None:
        with self._cv:
            self._closed = self._parked = False
            self.owner = None
            held, self._held = self._held, []
            self._cv.notify_all()
        for q, fn in held:
            q.put(fn)

    def hold(self, q: queue.Queue, fn) -> None:
        """Queue ``fn`` on ``q`` when the gate opens (the closing thread's submission)."""
        self._held.append((q, fn))

    @property
    def parked(self) -> bool:
        return self._parked

    def closed_by_me(self) -> bool:
        return self._closed and self.owner == threading.get_ident()

    def pass_(self) -> None:
        """Wait (a background thread) until the gate is open."""
        if not self._closed:
            return
        with self._cv:
            while self._closed:
                self._cv.wait()


class _Worker:
    """One background thread running store jobs in submission order (``inline``: no
    thread; each job runs at submission, its error surfaced at the next wait, as the
    thread's would be)."""

    def __init__(self, device: torch.device, name: str = "hiermem-prefetch", inline: bool = False,
                 gate: _Gate | None = None):
        self._q: queue.Queue = queue.Queue()
        self._gate = gate
        self._cv = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self._inline = inline
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if inline:
            return
        # the store's small ops run single-threaded on this thread: sharing the intra-op
        # pool with the training thread costs it far more than they gain (2x per step on
        # a 2-core host).  With OpenMP the setting is per thread, but torch also keeps it
        # as the default of threads not yet started: put that default back once it is set
        self._single = _per_thread_intra_op()
        self._started = threading.Event()
        n = torch.get_num_threads()  # also fixes this thread's own count first
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if self._single:
            self._started.wait(60)
            torch.set_num_threads(n)

    def submit(self, fn: Callable[[], None]) -> None:
        if self._inline:
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        fn()
                else:
                    fn()
            except BaseException as e:  # surfaced at the next wait, like the thread's
                self._error = e
            return
        with self._cv:
            self._submitted += 1
        g = self._gate
        if g is not None and g.closed_by_me():
            g.hold(self._q, fn)
        else:
            self._q.put(fn)

    def _run(self) -> None:
        lower_this_thread()  # background work: the training thread first
        if self._single:
            torch.get_num_threads()  # this thread's lazy init first, or it would undo the next line
            torch.set_num_threads(1)
        self._started.set()
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else None
        while True:
            fn = self._q.get()
            if fn is None:
                return
            if self._gate is not None:
                self._gate.pass_()
            try:
                if ctx is not None:
                    with torch.cuda.stream(self._stream):
                        fn()
                else:
                    fn()
            except BaseException as e:  # surfaced on the training thread at its next wait
                self._error = e
            with self._cv:
                self._done += 1
                self._cv.notify_all()

    def busy(self) -> bool:
        with self._cv:
            return self._done < self._submitted

    def wait_idle(self, timeout: float | None = None) -> None:
        g = self._gate
        reopen = g is not None and g.closed_by_me()
        parked = reopen and g.parked
        if reopen:  # the jobs waited for may wait at the gate
            with self._cv:
                busy = self._done < self._submitted
            if busy:
                g.open()
            else:
                reopen = False
        try:
            with self._cv:
                if not self._cv.wait_for(lambda: self._done >= self._submitted, timeout):
                    raise TimeoutError("prefetch thread did not finish its jobs in time")
        finally:
            if reopen:  # as it was: closed, or parked
                g.close()
                if parked:
                    g.park()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        if self._inline:
            return
        self._q.put(None)
        self._thread.join(timeout=60)


@dataclass(eq=False)
class _Handle:
    """One batch's prefetch: its ticket once ``P`` ran, and what to do after its lookup."""

    pipe: "PrefetchPipeline"
    features: Any
    sf: SparseFeatures  # the features as the collection's (validated on the training thread)
    index: int = 0
    # the lookup's tensors, formed on the read-ahead thread (prepare): table of each id,
    # the ids as int64, the bags' offsets, the per-sample weights
    tables: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    prepared: threading.Event = field(default_factory=threading.Event)
    read_ahead: threading.Event = field(default_factory=threading.Event)  # its read-ahead ran
    plock: threading.Lock = field(default_factory=threading.Lock)
    result: Ticket | None = None
    submitted: bool = False
    next: "_Handle | None" = None  # the batch k steps later, prefetched after this lookup
    released: bool = False
    looked: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def prepare(self) -> None:
        """Form the lookup's tensors once (any thread; the first caller forms them, a
        second waits for it): the read-ahead thread, ahead of the batch, or whoever needs
        them first when it has fallen behind (an LMDB read of an earlier batch)."""
        with self.plock:
            if self.prepared.is_set():
                return
            try:
                self.tables, self.ids, self.offsets, self.weights = self.pipe.module.lookup_tensors(self.sf)
            finally:
                self.prepared.set()

    def ready(self) -> tuple | None:
        """The prepared ``(tables, ids, offsets, weights)``, or None when not formed (bad
        features: the lookup forms them again, and raises)."""
        self.prepare()
        return None if self.tables is None else (self.tables, self.ids, self.offsets, self.weights)

    # called by the module ----------------------------------------------------------------
    def ticket(self) -> Ticket | None:
        """Wait until every earlier store job is done; this batch's ticket (None if it
        was never prefetched)."""
        p = self.pipe
        late = self.submitted and not self.done.is_set()
        t0 = time.perf_counter()
        p._worker.wait_idle(p.timeout)
        p.wait_seconds += time.perf_counter() - t0
        r = self.result
        if r is None or not r.pinned:  # a lookup that places rows: earlier batches' pins go first
            p._drain_releases()
        if r is None or (not r.pinned and not r.accounted):  # a plain, accounted lookup follows
            p._set_lookahead(self)
        if late and self.result is not None:
            with p.store.lock:
                p.store.counters.add_io(IO.LATE_PREFETCHES, len(self.result))
            p.late_batches += 1
        p._effective_depth(self)
        return self.result

    def looked_up(self) -> None:
        self.looked = True
        # a pinned batch cannot lose its rows to the next prefetch: start it now, while
        # this step computes; an unpinned one would, so its successor waits for release
        if self.next is not None and prefetch_now(self.result):
            self.submit_next()

    def submit_next(self) -> None:
        """Submit the batch waiting on this one, and drop the link: a chain of handles,
        each holding the next, would keep every batch's ticket and tensors alive."""
        h, self.next = self.next, None
        if h is not None:
            self.pipe._submit(h)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        ticket = self.result
        if ticket is not None:
            p = self.pipe
            if self.next is None:
                # nothing waits on it: the next prefetch job unpins it first (the same
                # order: before any later batch is placed), or a wait does; the training
                # thread's backward neither runs it nor wakes a thread for it
                p._deferred.append((p._deferred_n, ticket))
                p._deferred_n += 1
            elif p._worker.busy():  # after the jobs already queued (the next batch's prefetch), in order
                p._worker.submit(lambda: p._timed_release(ticket))
            else:  # the same order: nothing is queued before it; no thread round trip
                p._timed_release(ticket)
        self.submit_next()


class PrefetchPipeline:
    """Iterate ``loader`` with its batches' rows prefetched ``depth`` batches ahead.

    Args:
        loader: any iterable of batches; each holds a :class:`SparseFeatures` (found by
            ``features``, default :func:`find_features`).
        module: the :class:`CachedEmbeddingBagCollection` the batches go through.
        depth: how many batches ahead to prefetch (>= 1); None (the default): the
            store config's ``prefetch_depth`` (its policy file's, else 2).
        features: ``batch -> SparseFeatures`` when the default cannot find them.
        timeout: seconds a step waits for the prefetch thread before ``TimeoutError``.
        gil_slice: while a pipeline with background threads is open, the interpreter's switch interval in seconds
            (``sys.setswitchinterval``; default :data:`GIL_SLICE`, put back at
            :meth:`close`; None leaves it): how long the training thread can wait for the
            GIL while a background thread runs Python.
        background: run prefetch and read-ahead on background threads (True), inline on
            the training thread in the same order (False: same placements and counters,
            no overlap), or decide from the machine (``"auto"``: threads where they can
            overlap the step, kept only if a trial measures the loop faster with them, else
            no prefetch at all; see :func:`choose_background`; :attr:`mode`,
            :attr:`background_reason` and ``stats()["trials"]`` say what was chosen).

    Yields the loader's batches unchanged.  Use as a context manager (or call
    :meth:`close`) so pins are released and the thread stops.
    """

    def __init__(self, loader: Iterable, module, depth: int | None = None,
                 features: Callable[[Any], Any] | None = None, timeout: float | None = 600.0,
                 background: bool | str = "auto", gil_slice: float | None = GIL_SLICE):
        if depth is None:  # the store's, from its policy file or the default
            cfg = getattr(module.store, "config", None)
            depth = getattr(cfg, "prefetch_depth", 2)
            if depth == 0:
                raise InvalidArgumentError(f"the store's policy ({cfg.policy}) sets prefetch_depth = 0 (no "
                                           "prefetch): iterate without a PrefetchPipeline or pass depth=")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise InvalidArgumentError(f"depth must be an int >= 1, got {depth!r}")
        self.module, self.store, self.depth = module, module.store, depth
        self.timeout = timeout
        self._features = features or find_features
        self._it = iter(loader)
        self._ahead: deque = deque()  # (batch, handle) read but not yet yielded
        self._live: deque = deque()  # handles yielded, not yet released
        self._recent: deque = deque(maxlen=depth)  # the last `depth` handles read
        # a lookahead policy sees the ids of `window` batches past each prefetched one
        # (window 0: the prefetch depth), so the loader is read that much further ahead
        pol = self.store.device_tier.policy
        self._window = (int(getattr(pol, "window", 0) or 0) or depth) if self.store.wants_lookahead else 0
        self._index: dict[int, _Handle] = {}  # handles by batch index, while they may be needed
        self._nread = 0
        self._exhausted = False
        self.mode, self.background_reason = choose_background(background, self.store.device,
                                                              lookahead=bool(self._window))
        self.background = self.mode == "threads"
        # "auto" chose threads because they *could* overlap: measure whether they do
        self.adaptive = (background == "auto" and self.background and not self._window
                         and os.environ.get("HIERMEM_BACKGROUND", "auto").strip().lower() not in MODES)
        self.trials: list[dict] = []
        self._trial: dict | None = None  # the trial under way: windows' samples and order
        self._next_trial = ADAPT_AFTER
        self._in_mode = 0  # steps since the mode last changed
        self._t_last: float | None = None
        self._draining = False
        self._gil_slice = gil_slice
        self._sliced = _slice_begin(gil_slice) if self.background else False
        self._gate = _Gate()
        self._worker = _Worker(self.store.device, inline=not self.background, gate=self._gate)
        self._reader = _Worker(torch.device("cpu"), name="hiermem-read-ahead", inline=not self.background,
                               gate=self._gate)
        self._keep = depth + 2 + self._window  # read-ahead batches the disk tier keeps
        self.wait_seconds = 0.0
        self.next_seconds = 0.0  # the training thread's, in __next__
        self.prefetch_seconds = 0.0  # store.prefetch and release (on the prefetch thread, or inline when it is idle)
        self.read_ahead_seconds = 0.0  # store.read_ahead on the read-ahead thread (only it adds)
        self.read_ahead_wait_seconds = 0.0  # the prefetch thread's, waiting for a batch's read-ahead
        self.late_batches = 0
        self.steps = 0
        self._depth_sum = 0
        self.min_effective_depth = depth
        self._closed = False
        self._initial: list[_Handle] = []
        self._deferred: deque = deque()  # (seq, ticket) of finished batches, to unpin (see _Handle.release)
        self._deferred_n = 0
        if self.mode == "foreground":  # batches pass through; the module's lookups place their rows
            self.min_effective_depth = 0  # no batch is ever held ahead
            return
        self._fill()
        self._submit_initial()

    # -- internals ---------------------------------------------------------------------
    def _read(self) -> bool:
        try:
            batch = next(self._it)
        except StopIteration:
            self._exhausted = True
            return False
        f = self._features(batch)
        sf = self.module.as_features(f)
        h = _Handle(self, f, sf, index=self._nread)
        self._index[self._nread] = h
        self._index.pop(self._nread - self.depth - 2 * self._window - 2, None)
        self._nread += 1
        self.module.expect(f, h)
        self._reader.submit(lambda: self._read_ahead(h))
        if len(self._recent) < self.depth:  # the first k batches: prefetched once the window is read
            self._initial.append(h)
        else:  # batch j is prefetched right after the lookup of batch j - depth
            prev = self._recent[0]
            if prev.released or (prev.looked and prefetch_now(prev.result)):
                self._submit(h)
            else:
                prev.next = h
        self._recent.append(h)
        self._ahead.append((batch, h))
        return True

    def _submit_initial(self) -> None:
        """Prefetch the first ``depth`` batches read (and hold them no longer)."""
        hs, self._initial = self._initial, []
        for h in hs:
            self._submit(h)

    def _read_ahead(self, h: _Handle) -> None:
        t0 = time.perf_counter()
        try:
            h.prepare()
            if h.tables is not None:
                self.store.read_ahead(h.tables, h.ids, keep=self._keep)
        except HierMemError:  # only speed is lost: the prefetch or lookup reads, and raises
            pass
        finally:
            self.read_ahead_seconds += time.perf_counter() - t0
            h.read_ahead.set()

    def _submit(self, h: _Handle) -> None:
        if h.submitted:
            return
        h.submitted = True
        upto = self._deferred_n

        def job():
            # the batch's LMDB reads are its read-ahead's, done outside the store's lock: wait
            # for it rather than read them here, under the lock, one table at a time (which
            # the training thread's lookup would then wait for)
            t_w = time.perf_counter()
            if not h.read_ahead.wait(self.timeout):
                raise TimeoutError("read-ahead thread did not finish a batch in time")
            t0 = time.perf_counter()
            self.read_ahead_wait_seconds += t0 - t_w
            try:
                self._drain_releases(upto)
                h.prepare()
                self._set_lookahead(h)
                if h.tables is not None:  # bad features: the lookup raises
                    h.result = self.store.prefetch(h.tables, h.ids, h.offsets, self.module.mode, h.weights,
                                                   samples=self.module.lookup_samples(h.sf))
            finally:
                self.prefetch_seconds += time.perf_counter() - t0
                h.done.set()
        self._worker.submit(job)

    def _drain_releases(self, upto: int | None = None) -> None:
        """Unpin the finished batches' deferred tickets (each once): all of them, or (a
        prefetch job) those deferred before ``upto``, the count when it was submitted, so a
        job that starts late unpins what an inline one would have, no more."""
        d = self._deferred
        while d and (upto is None or d[0][0] < upto):
            self._timed_release(d.popleft()[1])

    def _timed_release(self, ticket: Ticket) -> None:
        t0 = time.perf_counter()
        try:
            self.store.release(ticket)
        finally:
            self.prefetch_seconds += time.perf_counter() - t0

    def _set_lookahead(self, h: _Handle) -> None:
        """Tell a lookahead policy the rows of the ``window`` batches after ``h``."""
        if not self._window:
            return
        nxt = [self._index[j] for j in range(h.index + 1, h.index + 1 + self._window) if j in self._index]
        for x in [h] + nxt:
            x.prepare()
        if nxt:
            when = torch.cat([torch.full((x.ids.numel(),), x.index - h.index, dtype=torch.int64) for x in nxt])
            self.store.set_lookahead(torch.cat([x.tables for x in nxt]), torch.cat([x.ids for x in nxt]), when)
        else:
            self.store.set_lookahead(h.tables[:0], h.ids[:0])

    def _fill(self) -> None:
        # one batch past the prefetch depth (and lookahead window): its read-ahead then has
        # a whole step to finish before its prefetch starts
        while not self._draining and not self._exhausted and len(self._ahead) < self.depth + 2 + self._window:
            self._read()

    # -- iteration -------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        shut = self._gate.close()
        try:
            return self._next()
        finally:
            if shut:  # the batch's forward (or the next entry) opens it
                self._gate.park()
            self.next_seconds += time.perf_counter() - t0

    @property
    def critical_path_seconds(self) -> float:
        """Seconds the training thread has spent inside hiermem: taking batches from this
        pipeline, and the module's forwards and backwards (what the step waits for)."""
        t = self.module.thread_seconds
        return self.next_seconds + t["forward"] + t["backward"]

    def _next(self):
        if self._closed:
            raise StopIteration
        if self.adaptive:
            self._adapt()
        if self.mode == "threads" and self._draining and not self._ahead:
            self._enter_foreground()
        if self.mode == "foreground":
            try:
                batch = next(self._it)
            except StopIteration:
                self.close()
                raise
            self.steps += 1
            self._in_mode += 1
            return batch
        while self._live:  # batches whose backward never ran (eval, skipped): unpin them
            h = self._live.popleft()
            self.module.forget(h.features)
            if not h.looked:
                h.submit_next()
            h.release()
        self._fill()
        if not self._ahead:
            self.close()
            raise StopIteration
        batch, h = self._ahead.popleft()
        self._live.append(h)
        self.steps += 1
        self._in_mode += 1
        return batch

    # -- "auto": prefetch threads only where they measure faster ----------------------------
    @property
    def mode_settled(self) -> bool:
        """False while ``"auto"`` has yet to measure its first trial, or is measuring one
        (a benchmark's warm-up waits for this before it times steady state)."""
        return not self.adaptive or (self._trial is None and bool(self.trials) and not self._draining)

    def _settled(self) -> bool:
        """Whether the step that just ended ran wholly in the current mode, past the
        steps a switch disturbs (the prefetch queue filling, or draining)."""
        return not self._draining and self._in_mode > self.depth + 2

    def _adapt(self) -> None:
        """Time the step that just ended; run the trial's schedule (see ``ADAPT_*``)."""
        now = time.perf_counter()
        last, self._t_last = self._t_last, now
        tr = self._trial
        if tr is None:
            if self.steps >= self._next_trial and not self._draining:
                self._trial = {"step": self.steps, "samples": {"threads": [], "foreground": []}, "window": 0, "n": 0}
            return
        if last is None or not self._settled():
            return
        tr["samples"][self.mode].append(now - last)
        tr["n"] += 1
        if tr["n"] < ADAPT_STEPS:
            return
        tr["window"], tr["n"] = tr["window"] + 1, 0
        if tr["window"] < ADAPT_WINDOWS:
            self._switch("foreground" if self.mode == "threads" else "threads")
            return
        med = {m: float(np.median(v)) for m, v in tr["samples"].items()}
        choice = "threads" if med["threads"] < ADAPT_MARGIN * med["foreground"] else "foreground"
        self.trials.append({"step": tr["step"], "threads_ms": round(1e3 * med["threads"], 3),
                            "foreground_ms": round(1e3 * med["foreground"], 3), "chose": choice})
        del self.trials[:-8]
        self.background_reason = (f"auto, measured at step {tr['step']}: {1e3 * med['threads']:.2f} ms/step with "
                                  f"prefetch threads, {1e3 * med['foreground']:.2f} without: {choice}")
        self._trial, self._next_trial = None, self.steps + ADAPT_EVERY
        if choice != self.mode:
            self._switch(choice)

    def _switch(self, mode: str) -> None:
        if mode == "threads":
            self.mode, self._in_mode = "threads", 0
            self._recent.clear()
            self._initial = []
            self._fill()
            self._submit_initial()
        else:  # the batches already read ahead (and prefetched) are yielded first
            self._draining, self._in_mode = True, 0

    def _enter_foreground(self) -> None:
        """The last prefetched batch is done with: unpin it and pass batches through."""
        while self._live:
            h = self._live.popleft()
            self.module.forget(h.features)
            h.next = None
            h.release()
        self.wait_idle()
        self.store.disk.drop_read_ahead()  # nothing reads ahead now: spare reads and writes the cache's checks
        self._recent.clear()
        self.mode, self._draining, self._in_mode = "foreground", False, 0

    def _effective_depth(self, h: _Handle) -> None:
        """Batches among this one and the next ``depth - 1`` held entirely on the device."""
        hs = [h] + [a for _, a in list(self._ahead)[:self.depth - 1]]
        eff = sum(1 for a in hs if a.result is not None and a.result.pinned and a.result.on_device)
        self._depth_sum += eff
        if len(hs) == self.depth:  # the last batches of a finite loader have fewer ahead
            self.min_effective_depth = min(self.min_effective_depth, eff)

    def stats(self) -> dict:
        """Pipeline counters: steps, whether (and why) prefetch runs on background threads,
        seconds waited for prefetch, seconds of the background threads' store calls (prefetch and release; read-ahead), late batches, effective depth."""
        st = self.store.stats()["_store"]
        return {"steps": self.steps, "depth": self.depth, "mode": self.mode, "background": self.background,
                "background_reason": self.background_reason, "adaptive": self.adaptive, "trials": list(self.trials), "wait_seconds": self.wait_seconds,
                "critical_path_seconds": self.critical_path_seconds,
                "prefetch_seconds": self.prefetch_seconds, "read_ahead_seconds": self.read_ahead_seconds,
                "read_ahead_wait_seconds": self.read_ahead_wait_seconds,
                "late_batches": self.late_batches, "min_effective_depth": self.min_effective_depth,
                "mean_effective_depth": self._depth_sum / max(1, self.steps),
                "prefetched_batches": st["prefetched_batches"], "prefetch_degraded": st["prefetch_degraded"],
                "prefetched_rows": st["prefetched_rows"], "prefetch_hits": st["prefetch_hits"],
                "late_prefetches": st["late_prefetches"]}

    def wait_idle(self) -> None:
        """Block until the prefetch and read-ahead threads have run every job submitted so
        far (a benchmark's clock then holds all the background work of its steps), and
        unpin the batches already done with."""
        self._worker.wait_idle(self.timeout)
        self._reader.wait_idle(self.timeout)
        self._drain_releases()

    def close(self) -> None:
        """Release every pin and stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in list(self._live) + [h for _, h in self._ahead]:
            self.module.forget(h.features)
            h.next = None
            h.release()
        self._live.clear()
        self._ahead.clear()
        try:
            self.wait_idle()
        finally:
            self._worker.close()
            self._reader.close()
            if self._sliced:
                self._sliced = False
                _slice_end()

    def __enter__(self) -> "PrefetchPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
