"""The one place that creates drivetrain's default process group, and thin collectives over it.

Every engine, role and launcher creates the default group through :func:`init_distributed`, with a backend per
device type: host scalars and pickled objects (token counts, micro-batch counts, metrics, checkpoint verdicts)
travel over gloo on the CPU, device tensors over nccl on CUDA (``"cpu:gloo,cuda:nccl"``). A process that was
not launched by torchrun gets a one-rank group over an in-memory store, so one process builds the same
meshes and runs the same engine code as many. The host reductions here return their values at once over a
group of one rank (and without any group: pure data helpers), where a collective would only add its fixed
cost.

Collectives always run with the engine's timeout so that a dead rank fails the others instead of hanging them.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._config import ConfigError

ProcessGroup = dist.ProcessGroup

_BACKENDS = {"cpu": "cpu:gloo", "cuda": "cpu:gloo,cuda:nccl"}


def backend_for(device: str) -> str:
    """The ``init_process_group`` backend for an engine device: gloo for host tensors, nccl for CUDA ones.

    Raises:
        ConfigError: no backend is known for ``device``.

    NOTE: a CUDA run still needs a CPU backend. The scalars that every rank must agree on are Python
    numbers on the host; an nccl-only group rejects them ("No backend type associated with device type
    cpu"), and moving them to the GPU would cost a host sync per collective.
    """
    if device not in _BACKENDS:
        raise ConfigError(
            f"engine.device={device!r} has no collective backend; supported devices: {sorted(_BACKENDS)}."
        )
    return _BACKENDS[device]


def init_distributed(device: str = "cpu", timeout_s: float = 600.0) -> None:
    """Create the default process group once, for this process's launch, with a CPU backend.

    Under torchrun (``WORLD_SIZE`` set) the group joins the launched world through its environment; on CUDA
    each rank first selects ``cuda:LOCAL_RANK``. A process that was not launched gets a one-rank group over an
    in-memory store. A group that already exists is kept, provided it can reduce host tensors and ``device``'s.

    Raises:
        ConfigError: this process sees no ``device`` (or fewer than its local rank needs), or an existing default
            group has no CPU backend (e.g. ``init_process_group("nccl")``) or none for ``device`` (a group made
            for the CPU, then an engine on CUDA).
    """
    require_device(device)
    if dist.is_initialized():
        check_group_backends(device)
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    atexit.register(_destroy_at_exit)
    if "WORLD_SIZE" not in os.environ:
        dist.init_process_group(
            backend=backend_for(device), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend_for(device), timeout=timeout)


def _destroy_at_exit() -> None:
    """Tear down the group this module created before the interpreter exits.

    NOTE: this releases the group for processes whose libraries no longer hold it, and torch warns about a
    group left undestroyed. It cannot join gloo's threads while a library still holds the group (DTensor's
    caches hold FSDP2's meshes); the abort those threads can cause at teardown is avoided by ending drivetrain's
    processes through :mod:`.process_exit`.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def require_device(device: str) -> None:
    """Fail clearly when this process cannot run on ``device`` (a device type: ``cpu``, ``cuda``, ...).

    Raises:
        ConfigError: torch sees no device of that type here, or (for a launched rank) fewer than its
            ``LOCAL_RANK`` needs.
    """
    backend = getattr(torch, device, None) if device != "cpu" else None
    if backend is None or not hasattr(backend, "is_available"):
        return
    if not backend.is_available():
        raise ConfigError(
            f"engine.device={device!r}, but this process sees no {device} device (torch {torch.__version__}: "
            f"torch.{device}.is_available() is False). Set engine.device=cpu, or run where one is visible "
            "(check CUDA_VISIBLE_DEVICES, the driver and `drivetrain env`)."
        )
    # A launched rank selects the device of its LOCAL_RANK (see init_distributed).
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if "WORLD_SIZE" in os.environ else 0
    count = backend.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"this process is local rank {local_rank} on engine.device={device!r}, but only {count} {device} "
            f"device(s) are visible; start at most {count} processes per node (torchrun --nproc-per-node "
            f"{count}, drivetrain --nproc {count}), or set engine.device=cpu to run them on the CPU."
        )


def check_group_backends(device: str) -> None:
    """Fail clearly when the default group cannot reduce CPU tensors (see :func:`backend_for`) or ``device``'s.

    NOTE: a group created for the CPU (``cpu:gloo``) kept by a later CUDA engine failed in FSDP2's first
    collective with "No backend type associated with device type cuda".

    Raises:
        ConfigError: the group's backends do not cover the ``cpu`` device type, or ``device``.
    """
    config = dist.get_backend_config()
    device_types = {pair.split(":")[0] for pair in config.split(",") if ":" in pair}
    missing = [d for d in dict.fromkeys(("cpu", device)) if d not in device_types]
    if missing:
        raise ConfigError(
            f"the default process group was created with backend {config!r}, which has no {missing[0].upper()} "
            f"backend; drivetrain reduces host scalars over the CPU and engine.device={device!r} tensors on its "
            "own: create it with init_process_group(backend='cpu:gloo,cuda:nccl') or let drivetrain create it "
            "(drivetrain_engine_core.job.init_distributed)."
        )


def world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def barrier(group: ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def all_reduce_sum(value: float | int, group: ProcessGroup | None = None) -> float:
    """Sum a Python number over ``group`` and return it as a float (identity without a process group)."""
    return all_reduce_sums([value], group)[0]


def all_reduce_sums(values: Sequence[float | int], group: ProcessGroup | None = None) -> list[float]:
    """Sum several host numbers over ``group`` in one collective on the CPU backend (the identity over a group
    of one rank or without a process group)."""
    return _all_reduce_host(values, dist.ReduceOp.SUM, group)


def all_reduce_max(value: float | int, group: ProcessGroup | None = None) -> float:
    """Maximum of a host number over ``group`` (identity without a process group)."""
    return all_reduce_maxes([value], group)[0]


def all_reduce_maxes(values: Sequence[float | int], group: ProcessGroup | None = None) -> list[float]:
    """Element-wise maxima of several host numbers over ``group`` in one collective (negate for minima)."""
    return _all_reduce_host(values, dist.ReduceOp.MAX, group)


def _all_reduce_host(
    values: Sequence[float | int], op: dist.ReduceOp.RedOpType, group: ProcessGroup | None
) -> list[float]:
    if world_size(group) == 1:
        # NOTE: a one-rank gloo all-reduce still costs ~0.2 ms of host time; on a small model's SFT step the
        # four per step were 4% of it (profiled), for no change in any value.
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def broadcast_object(obj: object, src: int = 0, group: ProcessGroup | None = None) -> object:
    """Broadcast a picklable object from global rank ``src`` (identity without a process group)."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def all_gather_objects(obj: object, group: ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[object] = [None] * world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
