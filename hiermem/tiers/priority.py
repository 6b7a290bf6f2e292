"""Background work yields the CPU to the training thread.

hiermem's background threads (prefetch, read-ahead, the LMDB writer) and its LMDB child
processes run at a lower scheduling priority (``nice`` +``BACKGROUND_NICE``, Linux per
thread): where their work and the step's contend for the cores (2 cores, or a GPU host's
cores busy with data loading), the scheduler runs the step first and the background work
in the time the step leaves, instead of preempting the training thread for whole time
slices.  Measured in ``scripts/bench_pipeline.py`` (Criteo-shaped, disk-backed, 2
cores): see docs/performance.md.  ``HIERMEM_BACKGROUND_NICE=0`` turns it off.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 10


def nice_value() -> int:
    try:
        return max(0, min(19, int(os.environ.get("HIERMEM_BACKGROUND_NICE", BACKGROUND_NICE))))
    except ValueError:
        return BACKGROUND_NICE


def lower_this_thread() -> None:
    """Lower the calling thread's priority (a no-op where the OS has no per-thread nice)."""
    n = nice_value()
    if not n or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + n))
    except (OSError, AttributeError):
        pass


def lower_process(pid: int) -> None:
    """Lower a child process's priority."""
    n = nice_value()
    if not n or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, pid) + n))
    except OSError:
        pass
