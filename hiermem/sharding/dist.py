"""torch.distributed plumbing: local launches and the few collectives sharding needs.

gloo (CPU) in torch 2.13 has ``all_to_all_single`` with uneven splits, ``all_gather``
(equal sizes) and ``all_reduce``; variable-size gathers are built from a size
``all_gather`` plus a padded ``all_gather``.

Device-generic: every helper runs its collective on the group's :func:`comm_device`
(the current CUDA device for NCCL, the CPU for gloo), moving its input there and its
result back to the input's device, so callers keep their tensors where they are (on the
CPU, CUDA tensors go over NCCL).  On gloo with CPU tensors nothing is copied.
"""

from __future__ import annotations

import os
import socket
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per local rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch_local(world_size: int, fn: Callable, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes in one group.

    Uses ``torch.multiprocessing.spawn`` and a free loopback port (``MASTER_ADDR`` is
    127.0.0.1).  ``fn`` must be picklable (a module-level function).  A failure in any
    rank raises here.  ``backend="nccl"`` puts rank ``r`` on GPU ``r % device_count``.
    For several hosts use ``torchrun`` instead (see docs/sharding.md).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    mp.spawn(_entry, args=(world_size, free_port(), backend, fn, args), nprocs=world_size, join=True)


def comm_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where ``group``'s collectives run: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_to_all(send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
               group: Optional[dist.ProcessGroup] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    """``all_to_all_single`` of a 1-D tensor with uneven splits, on ``device`` (default
    :func:`comm_device`); the result is on ``send``'s device."""
    dev = device if device is not None else comm_device(group)
    out = torch.empty(int(sum(recv_splits)), dtype=send.dtype, device=dev)
    dist.all_to_all_single(out, send.to(dev).contiguous(), [int(x) for x in recv_splits],
                           [int(x) for x in send_splits], group=group)
    return out.to(send.device)


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """``all_reduce`` of ``x`` in place (on ``device``, default :func:`comm_device`); returns ``x``."""
    dev = device if device is not None else comm_device(group)
    y = x.to(dev)
    dist.all_reduce(y, op=op, group=group)
    if y is not x:
        x.copy_(y)
    return x


def all_gather_varlen(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                      device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """Every rank's ``x`` (same trailing shape, any length), in rank order, on ``x``'s device."""
    dev = device if device is not None else comm_device(group)
    world = dist.get_world_size(group)
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes_l = [int(s) for s in sizes]
    m = max(sizes_l)
    pad = torch.zeros((m,) + tuple(x.shape[1:]), dtype=x.dtype, device=dev)
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad, group=group)
    return [p[:s].to(x.device) for p, s in zip(parts, sizes_l)]
