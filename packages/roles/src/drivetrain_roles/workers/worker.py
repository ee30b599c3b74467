"""The process behind each Ray actor of a worker group: joins torch.distributed, builds a role, runs calls.

The class is plain Python; :class:`~.group.RayWorkerGroup` wraps it with ``ray.remote`` so this module imports
without Ray.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from .dispatch import WorkerTopology
from .spec import WorkerSpec


def _free_port() -> int:
    """A TCP port that is free on this node right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def join_world(spec: WorkerSpec, *, rank: int, world_size: int, master: tuple[str, int]) -> None:
    """Join the group's torch.distributed world as ``rank`` (the device and timeouts come from ``spec``)."""
    import torch
    from drivetrain_engine_core.job import init_distributed

    device = spec.engine_config.device
    os.environ.update(
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        # Ray gives each GPU actor exactly one visible device, which is cuda:0 inside the actor.
        LOCAL_RANK="0" if device == "cuda" else str(rank),
    )
    if device == "cpu" and spec.cpu_threads is not None:
        torch.set_num_threads(spec.cpu_threads)
    init_distributed(device, timeout_s=spec.timeout_s)


def build_role(spec: WorkerSpec, rank: int) -> tuple[Any, WorkerTopology]:
    """Build ``spec``'s engine and role in the world this process joined; return the role and its layout."""
    from drivetrain_engine_core.job import create_engine, plugins

    role_cls = plugins().roles.get(spec.role)
    engine = create_engine(
        model_config=spec.model_config,
        engine_config=spec.engine_config,
        optimizer_config=spec.optimizer_config,
        checkpoint_config=spec.checkpoint_config,
    )
    engine.initialize()
    if spec.role_config is None:
        role = role_cls(engine)
    elif isinstance(spec.role_config, Mapping):
        role = role_cls(engine, **spec.role_config)
    else:
        role = role_cls(engine, spec.role_config)
    topology = WorkerTopology(
        rank=rank,
        dp_rank=engine.data_parallel_rank,
        dp_size=engine.data_parallel_size,
        is_output_rank=engine.is_output_rank,
    )
    return role, topology


def role_method(role: Any, method: str, rank: int) -> Callable[..., Any]:
    """``role.<method>``, or an AttributeError that names the rank, the role class and its public methods."""
    target = getattr(role, method, None)
    if not callable(target):
        public = sorted(n for n in dir(role) if not n.startswith("_") and callable(getattr(role, n)))
        raise AttributeError(
            f"rank {rank}: role {type(role).__qualname__} has no method {method!r}; it has {public}."
        )
    return target


class RoleWorker:
    """One rank of a worker group: an initialised engine and the role built on it."""

    def __init__(self) -> None:
        self.role: Any = None
        self.rank = -1

    def rendezvous_address(self, local: bool) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` for the group, chosen on the node of rank 0.

        Args:
            local: the group runs on one machine, so the loopback address is enough.
        """
        import ray

        address = "127.0.0.1" if local else ray.util.get_node_ip_address()
        return address, _free_port()

    def setup(
        self, spec: WorkerSpec, *, rank: int, world_size: int, master: tuple[str, int]
    ) -> WorkerTopology:
        """Join the process group as ``rank`` of ``world_size``, then build the engine and the role.

        Returns:
            This worker's place in the data-parallel layout, as its engine reports it.
        """
        join_world(spec, rank=rank, world_size=world_size, master=master)
        self.rank = rank
        self.role, topology = build_role(spec, rank)
        return topology

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.<method>(*args, **kwargs)`` and return its result.

        Raises:
            AttributeError: the role has no such method (names the role class and its public methods).
        """
        return role_method(self.role, method, self.rank)(*args, **kwargs)

    def close(self) -> None:
        """Leave the process group so the actor can exit cleanly."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
