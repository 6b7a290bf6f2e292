"""Whether background work (prefetch, read-ahead, write-behind) can overlap a training
step on this machine, and why: the one rule behind every ``"auto"`` default.

Background work only pays where something runs beside it: a GPU computing the step while
the host's threads move rows, or a core that torch's intra-op threads leave free.  On a
CPU whose cores all run the model's ops, a background thread takes cores from them
(measured in ``scripts/bench_train.py`` on 2 cores: prefetch threads at 0.69x and
write-behind at 0.92x of doing the same work in the step), so ``"auto"`` degrades to
foreground work there.
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """Cores this process may run on beyond the training thread's intra-op threads."""
    return available_cores() - torch.get_num_threads()


def can_overlap(device: torch.device) -> tuple[bool, str]:
    """``(True, why)`` where background work runs beside the step on ``device``."""
    if device.type == "cuda":
        return True, "the device is a GPU: the host's threads overlap its compute"
    free = free_cores()
    if free > 0:
        return True, f"{free} core(s) free beside torch's {torch.get_num_threads()} intra-op threads"
    return False, f"no core free beside torch's {torch.get_num_threads()} intra-op threads"


def resolve_write_behind(write_behind: bool | str, device: torch.device) -> tuple[bool, str]:
    """``StoreConfig.write_behind`` as a bool, and why: ``"auto"`` commits eviction
    write-backs on a writer thread where it can overlap the step, synchronously where not."""
    if isinstance(write_behind, bool):
        return write_behind, "asked for"
    if write_behind == "combined":
        return True, "asked for: combined write-backs, committed by the writer thread"
    on, why = can_overlap(device)
    return on, f"auto: {why}"
