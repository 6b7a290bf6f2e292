"""Plain value types: table specs, tiers, store configuration."""

from __future__ import annotations

import enum
import math
import numbers
import os
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Optional, Union

from .errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:  # pragma: no cover
    from .dataplane.optim import Optimizer

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,127}")

#: Largest id accepted by an unbounded table (ids are non-negative int64).
MAX_ID = 2**63 - 1


class Tier(enum.IntEnum):
    """Where a row's latest value lives.  The hierarchy is *exclusive* above disk."""

    DEVICE = 0  #: a slot of the device tier (GPU HBM, or ``cpu``)
    HOST = 1  #: a slot of the host tier (pinned host memory when CUDA is present)
    DISK = 2  #: the LMDB store on disk
    INIT = 3  #: never written: the value is the deterministic initialiser's

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Args:
        name: identifier (letters, digits, ``_.-``), unique in a store.
        num_rows: number of rows, or ``None`` for an unbounded table whose ids are any
            non-negative int64 (hashed feature ids).  Unbounded tables cost nothing
            until a row is touched.
        dim: embedding dimension.
        init_bound: rows start uniform in ``[-init_bound, init_bound]``; defaults to
            ``1 / sqrt(dim)``.
    """

    name: str
    num_rows: Optional[int]
    dim: int
    init_bound: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidArgumentError(f"table name {self.name!r} must match {_NAME.pattern}")
        if self.num_rows is not None:
            if isinstance(self.num_rows, bool) or not isinstance(self.num_rows, int):
                raise InvalidTypeError(f"table {self.name}: num_rows must be an int or None")
            if self.num_rows <= 0:
                raise InvalidArgumentError(f"table {self.name}: num_rows must be > 0, got {self.num_rows}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim <= 0:
            raise InvalidArgumentError(f"table {self.name}: dim must be a positive int, got {self.dim!r}")
        if self.init_bound is not None and (isinstance(self.init_bound, bool)
                                            or not isinstance(self.init_bound, numbers.Real)):
            raise InvalidTypeError(f"table {self.name}: init_bound must be a real number, got {self.init_bound!r}")
        if self.init_bound is not None and not (math.isfinite(self.init_bound) and self.init_bound >= 0):
            raise InvalidArgumentError(f"table {self.name}: init_bound must be finite and >= 0")

    @property
    def bound(self) -> float:
        return self.init_bound if self.init_bound is not None else 1.0 / math.sqrt(self.dim)

    @property
    def max_id(self) -> int:
        return MAX_ID if self.num_rows is None else self.num_rows - 1

    def to_dict(self) -> dict:
        return {"name": self.name, "num_rows": self.num_rows, "dim": self.dim, "init_bound": self.bound}

    @classmethod
    def from_dict(cls, d: dict) -> "TableSpec":
        return cls(d["name"], d["num_rows"], int(d["dim"]), float(d["init_bound"]))


def default_device() -> str:
    """``"cuda"`` when a GPU is usable, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class StoreConfig:
    """How a :class:`~hiermem.HierarchicalStore` is laid out.

    Args:
        path: directory of the LMDB store (created if missing).
        device: device of the device tier (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
        device_rows: slots in the device tier (rows of any table; padded to the widest).
            None (the default): the policy file's ``device_rows``, else 10,000.
        host_rows: slots in the host tier (pinned host memory when CUDA is present).
            None (the default): the policy file's ``host_rows``, else 100,000.
        policy: a registered policy name (``"lru"``, ``"lfu"``, ...) or the path of a
            policy TOML file.  A file's ``device_rows``, ``host_rows`` and
            ``prefetch_depth`` apply where those arguments are None; an explicit
            argument wins.  A config is a value and reads no file: with a policy file
            those three stay None until :meth:`resolved` reads it (the store does, when
            it opens, and records the effective values in its metadata).
        optimizer: the row optimizer applied by ``update`` (default ``SGD(lr=0.01)``).
        seed: seed of the per-row initialiser.
        map_size: initial LMDB map size in bytes; it grows automatically when full.
        sync_writebacks: fsync every LMDB transaction (eviction write-backs too), not only
            ``flush()``.  Off by default: a process crash (even SIGKILL) loses nothing
            committed either way, since the OS holds the pages; on with power-loss or
            OS-crash exposure between flushes, at one fsync per evicting batch.
        write_behind: commit eviction write-backs to LMDB on a writer thread (at most
            two batches behind; reads see queued rows), off the training step's path.
            Off by default: a write that fails in the background (a full disk) is then
            retried and raised, typed, by the next call that writes or flushes, not by
            the lookup that evicted; nothing is lost (the rows stay queued).
            ``"auto"``: on where the writer thread can overlap the step (a GPU, or a
            core free beside torch's intra-op threads; :mod:`hiermem.store.overlap`), off
            where it would only take a core from the step; the store's
            ``write_behind``/``write_behind_reason`` say what was chosen.
            ``"combined"``: on, and the write-backs are first combined (``write_combine``
            rows a batch, as without write-behind), so the writer thread commits one
            transaction per ``write_combine`` rows instead of one per evicting batch.
        write_combine: eviction write-backs (without ``write_behind``, or with it
            ``"combined"``) are held in memory
            until this many rows are, then committed in one LMDB transaction, or with the
            next flush, checkpoint or ``close`` (:mod:`hiermem.tiers.combine`): an LMDB
            commit costs as much as a few hundred rows, so stores that evict a few
            hundred rows a step spent more on commits than on rows.  Reads see the rows
            held.  A crash loses what they hold as it loses any write-back not yet
            committed (rows keep their flushed value or a later one written down).
            0: commit every write-back; ``sync_writebacks`` implies 0.  None (the
            default): three times the LMDB leaf pages the tables' rows fill, at least
            16,384 rows and at most 64 MiB of records
            (:func:`hiermem.tiers.combine.default_limit`; e.g. 56k rows for 960k rows of
            64-byte records): a commit copies each page it touches once, so rows
            committed together that share pages cost less (the store's ``disk.combine.limit``
            is the limit in use).
        io_process: do the background LMDB I/O (read-ahead, write-behind) in a child
            process (lmdb and numpy only) instead of on the background thread itself.
            py-lmdb holds the GIL while it works, so in-thread background I/O stalls
            the training thread; in a process it runs beside it.  On by default where
            supported (Linux, where the child dies with its thread); a child that cannot
            start or fails falls back to in-thread I/O, with the same results.
        writemap: commit through LMDB's shared map (``MDB_WRITEMAP``) over a data file
            allocated in full up front (``posix_fallocate``): about half the cost of a
            scattered write-back, at the price of the map's size on disk (the map then
            starts at twice the store's pages, at least 8 MiB and at most ``map_size``,
            and doubles as it fills, each step allocated on disk).  None (the
            default): where the filesystem honours preallocation (ext2/3/4, XFS, tmpfs)
            and there is room for the map now; True: always (a copy-on-write filesystem
            such as btrfs could then fault on a full disk); False: never.
        trace_path: if set, record every lookup batch to this trace directory
            (:meth:`HierarchicalStore.record`), for offline policy tuning.
        prefetch_depth: the depth a :class:`~hiermem.PrefetchPipeline` over this store
            uses when not given one; None (the default): the policy file's, else 2.
    """

    path: Union[str, os.PathLike]
    device: str = "cpu"
    device_rows: Optional[int] = None
    host_rows: Optional[int] = None
    policy: str = "lru"
    optimizer: Optional["Optimizer"] = None
    seed: int = 0
    map_size: int = 1 << 28
    sync_writebacks: bool = False
    write_behind: Union[bool, str] = False
    write_combine: Optional[int] = None
    io_process: bool = True
    writemap: Optional[bool] = None
    trace_path: Optional[Union[str, os.PathLike]] = None
    prefetch_depth: Optional[int] = None

    #: the sizes and depth where neither the argument nor a policy file gives them
    DEFAULTS: ClassVar[tuple[tuple[str, int], ...]] = (("device_rows", 10_000), ("host_rows", 100_000),
                                                       ("prefetch_depth", 2))

    @property
    def policy_file(self) -> bool:
        """Whether ``policy`` names a policy file (anything not a registered name; no I/O)."""
        from .core.policies import POLICIES

        return os.fspath(self.policy) not in POLICIES

    def resolved(self) -> "StoreConfig":
        """This config with a policy file's sizes and depth filled in where they are None
        (the defaults where the file has none); ``self`` when nothing is left to read.

        Raises:
            PolicyFileError: unreadable file, unknown policy, or a bad size (by key).
        """
        missing = [n for n, _ in self.DEFAULTS if getattr(self, n) is None]
        if not missing:
            return self
        from .core.policies import policy_settings

        from_file = policy_settings(self.policy)
        return replace(self, **{n: from_file.get(n, d) for n, d in self.DEFAULTS if n in missing})

    def __post_init__(self) -> None:
        if not isinstance(self.policy, (str, os.PathLike)):
            raise InvalidTypeError("policy must be a name or a path")
        if not self.policy_file:  # a name: no file to read, the defaults apply now
            for name, default in self.DEFAULTS:
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        d = self.prefetch_depth
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise InvalidArgumentError(f"prefetch_depth must be an int >= 0, got {d!r}")
        for name in ("device_rows", "host_rows"):
            v = getattr(self, name)
            if v is None:  # a policy file's, read by resolved()
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidTypeError(f"{name} must be an int, got {type(v).__name__}")
            if v <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {v}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InvalidArgumentError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.map_size, int) or self.map_size < 1 << 20:
            raise InvalidArgumentError("map_size must be an int >= 1 MiB")
        for name in ("sync_writebacks", "io_process"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidTypeError(f"{name} must be a bool")
        c = self.write_combine
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise InvalidArgumentError(f"write_combine must be None or an int >= 0 (rows), got {c!r}")
        if not isinstance(self.write_behind, bool) and self.write_behind not in ("auto", "combined"):
            raise InvalidTypeError(f"write_behind must be a bool, 'auto' or 'combined', got {self.write_behind!r}")
        if self.writemap is not None and not isinstance(self.writemap, bool):
            raise InvalidTypeError("writemap must be a bool or None")
        if self.trace_path is not None and not isinstance(self.trace_path, (str, os.PathLike)):
            raise InvalidTypeError("trace_path must be a path or None")
        if self.optimizer is None:
            from .dataplane.optim import SGD

            object.__setattr__(self, "optimizer", SGD(lr=0.01))
