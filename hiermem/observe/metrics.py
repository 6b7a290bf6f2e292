"""Prometheus metrics, read from the stores' plain counters at scrape time.

The hot path never calls ``prometheus_client``: a store bumps int64 tensors indexed by
IntEnums (:mod:`hiermem.observe.stats`) and Python-list histograms.  A scrape calls
:meth:`StoreCollector.collect`, which takes each store's lock just long enough to copy
those counters (a few small tensors), releases it, then builds the metric families.

Thread-safety: :class:`MetricsRegistry` has its own lock; the collector holds a store's
lock only while copying, so a scrape delays a training step by at most that copy.

Metric names follow Prometheus conventions: ``hiermem_`` prefix, base units (seconds,
bytes), ``_total`` on counters; labels are only ``store``, ``table``, ``tier`` and
``policy``.  Denominators (see ``dashboards/README.md``): ``tier="device"`` lookups are
every id looked up; ``tier="host"`` lookups are the device misses; ``tier="disk"``
lookups are the host misses, so ``hits / lookups`` of one tier is that tier's
conditional hit rate.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .stats import IO, STAT_TIERS, Histogram, Stat


class MetricsRegistry:
    """Stores to export, by name, held by weak reference (a closed or collected store
    simply disappears from the metrics).  Every store adds itself to :data:`STORES`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stores: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()

    def add(self, store, name: str | None = None) -> str:
        """Register ``store`` under ``name`` (default: its path's basename, made unique
        with ``-2``, ``-3``, ...).  Returns the name used."""
        base = name or Path(store.path).name
        with self._lock:
            for have in self._stores.values():
                if have is store:
                    return next(k for k, v in self._stores.items() if v is store)
            for k, v in list(self._stores.items()):
                if v.closed:  # a closed store gives its name up
                    del self._stores[k]
            n, i = base, 1
            while n in self._stores:
                i += 1
                n = f"{base}-{i}"
            self._stores[n] = store
            return n

    def remove(self, store) -> None:
        with self._lock:
            for k, v in list(self._stores.items()):
                if v is store:
                    del self._stores[k]

    def items(self) -> list[tuple[str, object]]:
        with self._lock:
            return sorted(self._stores.items())


#: Every store registers itself here when it opens.
STORES = MetricsRegistry()


@dataclass
class _TierSnap:
    label: str
    capacity: int
    resident: list[int]  # rows per table
    occupied_bytes: int  # of the resident rows' records (host: each at its table's width)
    capacity_bytes: int  # of record storage allocated
    dirty: int
    pinned: int


@dataclass
class _Snap:
    """A copy of one store's counters, taken under its lock."""

    tables: list[str]
    policy: str
    table: torch.Tensor
    io: torch.Tensor
    tiers: list[_TierSnap]
    disk_rows: int
    disk_bytes: int
    map_size: int
    hists: dict[str, Histogram]
    disk_io: dict[str, int]  # read-ahead, write-behind queue, I/O processes, writemap
    reservoir_builds: dict[str, int]  # per tier label


def snapshot(store) -> _Snap | None:
    """Copy a store's counters under its lock (None when it is closed)."""
    with store.lock:
        if store.closed:
            return None
        c, n = store.counters, len(store.tables)
        tiers = []
        for tier in store.slot_tiers:
            # numpy, single-threaded: no contention with the training step's torch thread pool
            kt, dirty, pins = (x.cpu().numpy() for x in (tier.keys_t, tier.dirty, tier.pins))
            resident = np.bincount(kt + 1, minlength=n + 1)[1:].tolist()
            tiers.append(_TierSnap(tier.tier.label, tier.capacity, resident,
                                   tier.occupied_bytes(resident, store.widths), tier.record_bytes(),
                                   int(np.count_nonzero(dirty)), int(np.count_nonzero(pins))))
        disk = store.disk
        info, psize = disk.env.info(), disk.env.stat()["psize"]
        lmdb_read, lmdb_write = disk.durations()
        disk_io = {"read_ahead_rows": disk.ahead_rows, "read_ahead_hits": disk.ahead_hits,
                   "write_queue_rows": disk.queued, "combined_rows": disk.combined, "io_processes": disk.io_processes,
                   "io_failures": disk.io_failures, "writemap": int(disk.writemap)}
        return _Snap([s.name for s in store.tables], store.policy.name, c.table.clone(), c.io.clone(), tiers,
                     disk.count(), (info["last_pgno"] + 1) * psize, disk.map_size,
                     {"lookup": c.lookup_seconds.copy(), "update": c.update_seconds.copy(),
                      "copy": c.copy_seconds.copy(),
                      "lmdb_read": lmdb_read, "lmdb_write": lmdb_write}, disk_io,
                     {t.tier.label: t.policy.reservoir_builds for t in store.slot_tiers})


# (IO counter, metric name, help); the bytes counters are one family per tier pair
_IO_COUNTERS = (
    (IO.BYTES_HOST_TO_DEVICE, "hiermem_host_to_device_bytes_total", "Bytes of records moved host -> device."),
    (IO.BYTES_DEVICE_TO_HOST, "hiermem_device_to_host_bytes_total", "Bytes of records moved device -> host."),
    (IO.BYTES_DISK_TO_HOST, "hiermem_disk_to_host_bytes_total", "Bytes of records read from LMDB."),
    (IO.BYTES_HOST_TO_DISK, "hiermem_host_to_disk_bytes_total", "Bytes of records written to LMDB."),
    (IO.FLUSHES, "hiermem_flushes_total", "flush() calls (close included)."),
    (IO.FLUSHED_ROWS, "hiermem_flushed_rows_total", "Dirty rows written by flush()."),
    (IO.UPDATES, "hiermem_updates_total", "update/update_pooled calls."),
    (IO.UPDATED_ROWS, "hiermem_updated_rows_total", "Distinct rows given an optimizer step."),
    (IO.PREFETCH_REQUESTS, "hiermem_prefetch_requests_total", "Batches asked to be prefetched."),
    (IO.PREFETCHED_BATCHES, "hiermem_prefetched_batches_total", "Prefetched batches whose rows were pinned."),
    (IO.PREFETCH_PINNED_ROWS, "hiermem_prefetch_pinned_rows_total", "Distinct rows of prefetched batches (pinned)."),
    (IO.PREFETCHED_ROWS, "hiermem_prefetched_rows_total",
     "Distinct rows a prefetch moved up to the device tier ahead of need."),
    (IO.PREFETCH_HITS, "hiermem_prefetch_hits_total", "Ids of prefetched batches found on the device at lookup."),
    (IO.LATE_PREFETCHES, "hiermem_late_prefetches_total",
     "Rows of prefetched batches whose prefetch had not finished when the batch needed them."),
    (IO.PREFETCH_DEGRADED, "hiermem_prefetch_degraded_total",
     "Prefetch requests not held entirely on the device tier (refused, or spilled to host)."),
    (IO.PREFETCH_REVOKED, "hiermem_prefetch_revoked_total",
     "Prefetches unpinned early because a batch that was not prefetched needed the room."),
)
# (key of _Snap.disk_io, metric name, help, counter?)
_DISK_IO = (
    ("read_ahead_rows", "hiermem_disk_read_ahead_rows_total",
     "LMDB records read ahead of their batch (outside the store's lock) and kept.", True),
    ("read_ahead_hits", "hiermem_disk_read_ahead_hits_total",
     "Disk reads served from read-ahead records (the rest read LMDB in the step).", True),
    ("io_failures", "hiermem_disk_io_failures_total",
     "LMDB I/O child processes that failed to start or died (their work was redone in-process).", True),
    ("write_queue_rows", "hiermem_disk_write_queue_rows",
     "Rows in write-backs queued for the writer (write_behind), not yet committed.", False),
    ("combined_rows", "hiermem_disk_combined_rows",
     "Rows of eviction write-backs held for one combined commit (write_combine), not yet committed.", False),
    ("io_processes", "hiermem_disk_io_processes", "LMDB I/O child processes running now.", False),
    ("writemap", "hiermem_disk_writemap", "1 when LMDB commits through its preallocated map.", False),
)
_STAT_COUNTERS = (
    (Stat.LOOKUPS, "hiermem_lookups_total",
     "Lookups reaching the tier: device = every id; host = device misses; disk = host misses."),
    (Stat.HITS, "hiermem_hits_total", "Lookups of the tier served by it (denominator: the same tier's lookups)."),
    (Stat.MISSES, "hiermem_misses_total", "Lookups of the tier passed down (disk: rows created by the initialiser)."),
    (Stat.EVICTIONS, "hiermem_evictions_total", "Rows that left the tier for the one below."),
    (Stat.WRITEBACKS, "hiermem_writebacks_total", "Evicted rows that were dirty (carried down or written to LMDB)."),
)
_HISTOGRAMS = (
    ("lookup", "hiermem_lookup_duration_seconds", "lookup/lookup_pooled call time (under the store lock)."),
    ("update", "hiermem_update_duration_seconds", "update/update_pooled call time (under the store lock)."),
    ("copy", "hiermem_copy_duration_seconds",
     "One placement's record copies between the device and host tiers (on CUDA: issuing them)."),
    ("lmdb_read", "hiermem_lmdb_read_duration_seconds", "One batched LMDB read."),
    ("lmdb_write", "hiermem_lmdb_write_duration_seconds", "One LMDB write transaction (and its sync)."),
)


def _histogram(name: str, doc: str, store: str, h: Histogram) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=["store"])
    cum, buckets = 0, []
    for bound, n in zip(list(h.bounds) + [float("inf")], h.counts):
        cum += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
    fam.add_metric([store], buckets, h.sum)
    return fam


class StoreCollector(Collector):
    """A custom collector reading every store of a :class:`MetricsRegistry` at scrape time.

    Args:
        stores: the stores to export (default :data:`STORES`, every open store).
    """

    def __init__(self, stores: MetricsRegistry = STORES):
        self.stores = stores

    def collect(self) -> Iterator:
        snaps = [(name, snap) for name, st in self.stores.items() if (snap := snapshot(st)) is not None]
        info = GaugeMetricFamily("hiermem_store_info", "1 per open store, labelled with its policy.",
                                 labels=["store", "policy"])
        for name, s in snaps:
            info.add_metric([name, s.policy], 1)
        yield info
        for stat, mname, doc in _STAT_COUNTERS:
            fam = CounterMetricFamily(mname, doc, labels=["store", "table", "tier"])
            for name, s in snaps:
                for ti, table in enumerate(s.tables):
                    for tier in STAT_TIERS:
                        fam.add_metric([name, table, tier.label], int(s.table[ti, tier, stat]))
            yield fam
        for what, mname, doc in _IO_COUNTERS:
            fam = CounterMetricFamily(mname, doc, labels=["store"])
            for name, s in snaps:
                fam.add_metric([name], int(s.io[what]))
            yield fam
        for key, mname, doc, counter in _DISK_IO:
            fam = (CounterMetricFamily if counter else GaugeMetricFamily)(mname, doc, labels=["store"])
            for name, s in snaps:
                fam.add_metric([name], s.disk_io[key])
            yield fam
        fam = CounterMetricFamily("hiermem_victim_reservoir_builds_total",
                                  "Passes over the tier to rebuild its eviction policy's victim reservoir.",
                                  labels=["store", "tier"])
        for name, s in snaps:
            for tier, n in s.reservoir_builds.items():
                fam.add_metric([name, tier], n)
        yield fam
        yield from self._gauges(snaps)
        for key, mname, doc in _HISTOGRAMS:
            for name, s in snaps:
                yield _histogram(mname, doc, name, s.hists[key])

    @staticmethod
    def _gauges(snaps: list) -> Iterator:
        def g(name, doc, labels):
            return GaugeMetricFamily(name, doc, labels=labels)
        resident = g("hiermem_resident_rows", "Rows resident per table in the device and host tiers.",
                     ["store", "table", "tier"])
        occ = g("hiermem_occupancy_rows", "Occupied slots of the tier (disk: rows in LMDB).", ["store", "tier"])
        occ_b = g("hiermem_occupancy_bytes", "Bytes of the resident rows' records (host: each at its table's width; "
                  "disk: LMDB pages in use).", ["store", "tier"])
        cap = g("hiermem_capacity_rows", "Slots of the tier.", ["store", "tier"])
        cap_b = g("hiermem_capacity_bytes", "Bytes of the tier's record storage (host: its per-width pools as allocated; "
                  "disk: the LMDB map size).", ["store", "tier"])
        dirty = g("hiermem_dirty_rows", "Resident rows changed since last written to LMDB.", ["store", "tier"])
        pinned = g("hiermem_pinned_rows", "Rows pinned in the tier (pressure = pinned / capacity rows).",
                   ["store", "tier"])
        for name, s in snaps:
            for t in s.tiers:
                for table, n in zip(s.tables, t.resident):
                    resident.add_metric([name, table, t.label], n)
                rows = sum(t.resident)
                occ.add_metric([name, t.label], rows)
                occ_b.add_metric([name, t.label], t.occupied_bytes)
                cap.add_metric([name, t.label], t.capacity)
                cap_b.add_metric([name, t.label], t.capacity_bytes)
                dirty.add_metric([name, t.label], t.dirty)
                pinned.add_metric([name, t.label], t.pinned)
            occ.add_metric([name, "disk"], s.disk_rows)
            occ_b.add_metric([name, "disk"], s.disk_bytes)
            cap_b.add_metric([name, "disk"], s.map_size)
        yield from (resident, occ, occ_b, cap, cap_b, dirty, pinned)


_DEFAULT_COLLECTOR: StoreCollector | None = None
_DEFAULT_LOCK = threading.Lock()


def serve_metrics(port: int = 9400, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None,
                  stores: MetricsRegistry | None = None):
    """Serve ``/metrics`` over HTTP from a daemon thread.

    Args:
        port: TCP port (0: any free port; read it from ``server.server_port``).
        addr: address to bind; loopback unless told otherwise.
        registry: the ``prometheus_client`` registry to serve.  None: the default
            ``REGISTRY`` (process metrics too), with one :class:`StoreCollector` over
            :data:`STORES` registered in it once.  A registry passed in is served as
            given, plus a collector over ``stores`` when ``stores`` is given.
        stores: stores to export into ``registry``.

    Returns:
        ``(server, thread)``; ``server.shutdown()`` stops it.
    """
    global _DEFAULT_COLLECTOR
    if registry is None:
        registry = REGISTRY
        if stores is None:
            with _DEFAULT_LOCK:
                if _DEFAULT_COLLECTOR is None:
                    _DEFAULT_COLLECTOR = StoreCollector(STORES)
                    REGISTRY.register(_DEFAULT_COLLECTOR)
    if stores is not None:
        registry.register(StoreCollector(stores))
    return start_http_server(port, addr=addr, registry=registry)
