"""Store counters: plain int64 tensors indexed by IntEnums, bumped on the hot path.

Per table and tier (``Stat``), with these denominators, so conditional hit rates are
unambiguous (``hits / lookups`` of the same tier):

* ``device.lookups``: every id looked up, duplicates included.
* ``device.misses``: distinct rows of a batch not resident in the device tier at the
  start of that batch (a row fetched once serves all its duplicates: those count as hits).
* ``device.hits = device.lookups - device.misses``.
* ``host.lookups = device.misses``; ``host.hits``: of those, rows found in the host tier.
* ``disk.lookups = host.misses``; ``disk.hits``: rows read from LMDB; ``disk.misses``:
  rows never written, created by the initialiser.
* ``evictions``: rows that left the tier for the one below (device -> host, host ->
  disk); ``writebacks``: of those, the dirty ones (carried down, or written to LMDB).

Store-wide counters (``IO``) count bytes moved per tier pair, flushes and prefetch.  A
prefetched batch is accounted (lookups, hits, misses per tier) when it is prefetched, as
its lookup would have been; its lookup later counts ``PREFETCH_HITS`` (its ids found on
the device tier) instead.  ``PREFETCHED_ROWS`` counts distinct rows a prefetch moved up
to the device tier, ``LATE_PREFETCHES`` rows whose prefetch had not finished when the
batch needed them (the lookup waited), ``PREFETCH_DEGRADED`` prefetched batches that
could not be held entirely on the device tier beside the rows already pinned.

:class:`Histogram` holds duration buckets as plain Python numbers (one ``bisect`` and two
additions per observation); :mod:`hiermem.observe.metrics` reads them at scrape time.
"""

from __future__ import annotations

import bisect
import enum
import time
from functools import wraps

import torch

from ..core import names as _n
from ..types import Tier

SLOT_TIERS = (Tier.DEVICE, Tier.HOST)
STAT_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


class Stat(enum.IntEnum):
    """Counter positions per table and tier (:mod:`hiermem.core.names`, where the kernels read them)."""

    LOOKUPS = _n.LOOKUPS
    HITS = _n.HITS
    MISSES = _n.MISSES
    EVICTIONS = _n.EVICTIONS
    WRITEBACKS = _n.WRITEBACKS


class IO(enum.IntEnum):
    """Store-wide counter positions (:mod:`hiermem.core.names`, ``IO_*``)."""

    BYTES_HOST_TO_DEVICE = _n.IO_BYTES_HOST_TO_DEVICE
    BYTES_DEVICE_TO_HOST = _n.IO_BYTES_DEVICE_TO_HOST
    BYTES_DISK_TO_HOST = _n.IO_BYTES_DISK_TO_HOST
    BYTES_HOST_TO_DISK = _n.IO_BYTES_HOST_TO_DISK
    FLUSHES = _n.IO_FLUSHES
    FLUSHED_ROWS = _n.IO_FLUSHED_ROWS
    UPDATES = _n.IO_UPDATES
    UPDATED_ROWS = _n.IO_UPDATED_ROWS
    PREFETCHED_ROWS = _n.IO_PREFETCHED_ROWS  # distinct rows a prefetch moved up to the device tier ahead of need
    PREFETCH_HITS = _n.IO_PREFETCH_HITS  # ids of prefetched batches found on the device tier at lookup
    LATE_PREFETCHES = _n.IO_LATE_PREFETCHES  # rows whose prefetch was still in flight when their batch needed them
    PREFETCH_DEGRADED = _n.IO_PREFETCH_DEGRADED  # prefetched batches not entirely on the device tier
    PREFETCHED_BATCHES = _n.IO_PREFETCHED_BATCHES  # batches prefetched and pinned
    PREFETCH_REVOKED = _n.IO_PREFETCH_REVOKED  # prefetches unpinned early: an unprefetched batch needed the room
    PREFETCH_REQUESTS = _n.IO_PREFETCH_REQUESTS  # prefetch calls (batches asked for)
    PREFETCH_PINNED_ROWS = _n.IO_PREFETCH_PINNED_ROWS  # distinct rows of prefetched batches, pinned


assert len(Stat) == _n.NSTATS and len(IO) == _n.NIO
assert [int(t) for t in STAT_TIERS] == [_n.C_DEVICE, _n.C_HOST, _n.C_DISK] == list(range(_n.NSTAT_TIERS))

#: Upper bounds (seconds) of the duration histograms' buckets; a last ``+Inf`` is implied.
DURATION_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class Histogram:
    """Bucket counts of observed durations (seconds), as Prometheus histograms count them:
    ``counts[i]`` observations ``<= bounds[i]`` and above the bound before (the last:
    ``+Inf``).  Not locked: the store's lock guards it."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = DURATION_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def copy(self) -> "Histogram":
        h = Histogram(self.bounds)
        h.counts, h.sum = list(self.counts), self.sum
        return h

    @property
    def count(self) -> int:
        return sum(self.counts)


class Counters:
    """``table x tier x Stat`` and store-wide ``IO`` counters (CPU int64)."""

    def __init__(self, num_tables: int):
        self.num_tables = num_tables
        self.table = torch.zeros((num_tables, len(STAT_TIERS), len(Stat)), dtype=torch.int64)
        self.io = torch.zeros(len(IO), dtype=torch.int64)
        self._io = self.io.numpy()  # the same memory: a bump costs no torch op
        self.lookup_seconds = Histogram()  # lookup and lookup_pooled calls
        self.update_seconds = Histogram()  # update and update_pooled calls
        # a placement's record copies between tiers (CPU: the copies; CUDA: issuing them
        # on the side stream, which runs them asynchronously)
        self.copy_seconds = Histogram()

    def bump(self, tier: Tier, stat: Stat, t: torch.Tensor | int, n: int | None = None) -> None:
        """Add ``n`` to table ``t`` (an int), or one per element of tensor ``t``."""
        if isinstance(t, int):
            if n:
                self.table[t, tier, stat] += n
        elif t.numel():
            self.table[:, tier, stat] += torch.bincount(t.cpu(), minlength=self.num_tables)

    def add_io(self, what: IO, n: int) -> None:
        self._io[what] += int(n)

    def add_moves(self, up: int, down: int, width: int) -> None:
        """Bytes of ``up`` rows copied to the device and ``down`` rows to the host
        (records of ``width`` float32)."""
        self._io[IO.BYTES_HOST_TO_DEVICE] += up * width * 4
        self._io[IO.BYTES_DEVICE_TO_HOST] += down * width * 4


def timed(hist: str):
    """Decorator: record a store method's duration (under the store's lock) in ``counters.<hist>``."""
    def deco(fn):
        @wraps(fn)
        def timed(self, *args, **kwargs):
            with self._lock:
                t0 = time.perf_counter()
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    getattr(self.counters, hist).observe(time.perf_counter() - t0)
        return timed
    return deco


def store_stats(store, cumulative: bool = False) -> dict:
    """:meth:`HierarchicalStore.stats <hiermem.HierarchicalStore.stats>`: counters per
    table and tier (with each slot tier's occupancy), then the store-wide ``_store``
    figures, read through the store's public views (the caller holds its lock)."""
    table, io = store.cumulative_counters() if cumulative else (store.counters.table, store.counters.io)
    occ = store.residency.occupancy(len(store.tables))
    out: dict = {}
    for i, s in enumerate(store.tables):
        per = {}
        for tier in STAT_TIERS:
            d = {st.name.lower(): int(table[i, tier, st]) for st in Stat}
            if tier in occ:
                d["occupancy"] = occ[tier][i]
            per[tier.label] = d
        out[s.name] = per
    dev, host, disk = store.device_tier, store.host_tier, store.disk
    out["_store"] = {
        **{k.name.lower(): int(io[k]) for k in IO},
        "device_capacity": dev.capacity, "host_capacity": host.capacity,
        "device_occupancy": dev.occupancy, "host_occupancy": host.occupancy,
        "device_dirty": int(dev.dirty.sum()), "host_dirty": int(host.dirty.sum()),
        "device_record_bytes": dev.record_bytes(), "host_record_bytes": host.record_bytes(),
        "disk_rows": disk.count() if not store.closed else None,
        "lmdb_map_size": disk.map_size, "policy": store.policy.name,
        "disk_read_ahead_rows": disk.ahead_rows, "disk_read_ahead_hits": disk.ahead_hits,
        "disk_write_queue_rows": disk.queued, "disk_combined_rows": disk.combined,
        "disk_writemap": disk.writemap, "disk_io_processes": disk.io_processes,
        "disk_io_failures": disk.io_failures,
        "write_behind": store.write_behind, "write_behind_reason": store.write_behind_reason,
        "flush_seq": store.flush_seq, "prefetch_depth": store.config.prefetch_depth,
        "stale_temporaries_removed": store.stale_temporaries_removed,
    }
    return out
