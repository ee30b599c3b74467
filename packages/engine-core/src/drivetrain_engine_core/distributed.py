"""Thin helpers over ``torch.distributed`` that work the same with or without an initialised process group.

A single-process run (no ``torchrun``) behaves as a world of size 1, so engines, roles and tests use one code
path. Collectives always run with the engine's timeout so that a dead rank fails the others instead of
hanging them.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def default_backend_for(device: str) -> str:
    """The collective backend for a device type: nccl for cuda, gloo for everything else."""
    return "nccl" if device == "cuda" else "gloo"


def init_distributed(device: str = "cpu", timeout_s: float = 600.0) -> None:
    """Initialise the default process group from torchrun's environment, once; no-op for a single process."""
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=default_backend_for(device), timeout=datetime.timedelta(seconds=timeout_s)
    )


def world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def barrier(group: ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def all_reduce_sum(value: float | int, group: ProcessGroup | None = None, device: str = "cpu") -> float:
    """Sum a Python number over ``group`` and return it as a float (identity without a process group)."""
    return all_reduce_sums([value], group, device)[0]


def all_reduce_sums(
    values: Sequence[float | int], group: ProcessGroup | None = None, device: str = "cpu"
) -> list[float]:
    """Sum several Python numbers over ``group`` in one collective (identity without a process group)."""
    if not dist.is_initialized() or world_size(group) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.tolist()


def all_reduce_max(value: float | int, group: ProcessGroup | None = None, device: str = "cpu") -> float:
    """Maximum of a Python number over ``group`` (identity without a process group)."""
    if not dist.is_initialized() or world_size(group) == 1:
        return float(value)
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def broadcast_object(obj: object, src: int = 0, group: ProcessGroup | None = None) -> object:
    """Broadcast a picklable object from global rank ``src`` (identity without a process group)."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]
