"""A store's saved metadata read back: the configuration it reopens with, and the
lifetime counters of earlier sessions.  Pure functions of the metadata (the store writes
it, with every flush, checkpoint and write-back)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..errors import HierMemError, InvalidArgumentError, InvalidTypeError, StoreFormatError
from ..dataplane.optim import optimizer_from_dict
from ..observe.stats import IO, Counters
from ..tiers import DiskTier
from ..types import StoreConfig, TableSpec

#: the fields of a saved :class:`StoreConfig` that ``HierarchicalStore.open`` may replace
OVERRIDABLE = frozenset({"device", "device_rows", "host_rows", "policy", "prefetch_depth", "map_size",
                         "sync_writebacks", "write_behind", "write_combine", "io_process", "writemap", "trace_path"})


def saved_config(path: str | os.PathLike, overrides: dict) -> tuple[list[TableSpec], StoreConfig]:
    """The tables and config saved in the store at ``path``, with ``overrides``.

    Raises:
        StoreFormatError: ``path`` holds no store metadata, or corrupt metadata.
    """
    disk = DiskTier(path, create=False)
    try:
        meta = disk.read_meta()
    finally:
        disk.close()
    if meta is None:
        raise StoreFormatError(path, "an empty LMDB environment, not a hiermem store")
    overrides, explicit = dict(overrides), set(overrides)
    policy = overrides.pop("policy", meta.get("policy"))
    sizes = {k: overrides.pop(k, meta.get(k)) for k in ("device_rows", "host_rows", "prefetch_depth")}
    if "policy" in explicit:  # a policy file given now: its sizes over the saved ones
        from ..core.policies import policy_settings

        for k in policy_settings(policy):
            if k not in explicit:
                sizes[k] = None
    try:
        tables = [TableSpec.from_dict(d) for d in meta["tables"]]
        cfg = StoreConfig(path=path, device=meta["device"], policy=policy, seed=meta["seed"],
                          optimizer=optimizer_from_dict(meta["optimizer"]), **sizes)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, HierMemError) and not isinstance(e, (InvalidArgumentError, InvalidTypeError)):
            raise
        raise StoreFormatError(path, f"corrupt store metadata: {e}") from e
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        cfg = replace(cfg, device="cpu")
    return tables, replace(cfg, **overrides)


def saved_counters(saved: dict | None, like: Counters) -> tuple[torch.Tensor, torch.Tensor]:
    """The cumulative counters of earlier sessions (saved with the metadata, shaped as
    ``like``'s), or zeros."""
    table, io = torch.zeros_like(like.table), torch.zeros_like(like.io)
    try:
        t = torch.tensor(saved["table"], dtype=torch.int64)
        if t.shape == table.shape:
            table = t
        for k in IO:
            io[k] = int(saved["io"].get(k.name.lower(), 0))
    except (TypeError, KeyError, ValueError, AttributeError):
        pass  # none saved (a store from before counters were saved) or unreadable: from zero
    return table, io
