"""The process behind each Ray actor of a worker group: joins torch.distributed, builds a role, runs calls.

The class is plain Python; :class:`~.group.RayWorkerGroup` wraps it with ``ray.remote`` so this module imports
without Ray.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from .dispatch import WorkerTopology
from .spec import WorkerSpec


def _free_port() -> int:
    """A TCP port that is free on this node right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


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
        import torch
        from drivetrain_engine_core.distributed import init_distributed
        from drivetrain_engine_core.factory import create_engine
        from drivetrain_engine_core.plugins import plugins

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
        self.rank = rank
        role_cls = plugins().roles.get(spec.role)
        engine = create_engine(
            model_config=spec.model_config,
            engine_config=spec.engine_config,
            optimizer_config=spec.optimizer_config,
            checkpoint_config=spec.checkpoint_config,
        )
        engine.initialize()
        self.role = role_cls(engine) if spec.role_config is None else role_cls(engine, spec.role_config)
        return WorkerTopology(
            rank=rank,
            dp_rank=engine.data_parallel_rank,
            dp_size=engine.data_parallel_size,
            is_output_rank=engine.is_output_rank,
        )

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.<method>(*args, **kwargs)`` and return its result.

        Raises:
            AttributeError: the role has no such method (names the role class and its public methods).
        """
        target = getattr(self.role, method, None)
        if not callable(target):
            public = sorted(
                n for n in dir(self.role) if not n.startswith("_") and callable(getattr(self.role, n))
            )
            raise AttributeError(
                f"rank {self.rank}: role {type(self.role).__qualname__} has no method {method!r}; it has {public}."
            )
        return target(*args, **kwargs)

    def close(self) -> None:
        """Leave the process group so the actor can exit cleanly."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
