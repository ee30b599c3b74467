"""A driver-side group of Ray actors, one per rank, that run a role together as one torch.distributed job.

The driver creates the actors, lets rank 0 pick the rendezvous address, builds the role on every rank, then
dispatches global batches: each data-parallel rank gets its balanced shard (core's ``shard_indices``), every
worker runs the same role method, and the output ranks' answers are gathered back into the original order.
Every wait on a worker has a deadline and the first failing rank is reported by number (:mod:`.actors`).
"""

from __future__ import annotations

from typing import Any

from tensordict import TensorDict

from .actors import RayActors, WorkerGroupError, require_ray
from .dispatch import WorkerTopology, check_topology
from .spec import WorkerSpec
from .worker import RoleWorker

__all__ = ["RayWorkerGroup", "WorkerGroupError", "require_ray"]


class RayWorkerGroup(RayActors):
    """``world_size`` Ray actors that each build ``spec``'s engine and role and run as one distributed job.

    Args:
        spec: the role and engine configs every worker builds.
        world_size: number of workers (ranks).
        num_cpus_per_worker: Ray CPU resources per actor (fractions such as 0.5 are fine).
        num_gpus_per_worker: Ray GPU resources per actor; default 1 on ``cuda``, else 0.
        timeout_s: deadline of every wait on the workers (setup and each call).
        balance: balanced (Karmarkar-Karp) sharding; else contiguous chunks.

    Raises:
        ImportError: Ray is not installed.
        WorkerGroupError: a worker failed to start or to build its role (names the rank and the cause).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        world_size: int,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float | None = None,
        timeout_s: float = 300.0,
        balance: bool = True,
    ) -> None:
        self.spec = spec
        results = self._launch(
            RoleWorker,
            spec,
            device=spec.engine_config.device,
            world_size=world_size,
            resources=(num_cpus_per_worker, num_gpus_per_worker),
            timeout_s=timeout_s,
            balance=balance,
        )
        self.topology: list[WorkerTopology] = results
        check_topology(self.topology)

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``role.<method>(*args, **kwargs)`` on every worker with the same arguments.

        Returns:
            One result per worker, in rank order.
        """
        return self._wait([actor.call.remote(method, *args, **kwargs) for actor in self._actors], method)

    def dispatch(self, method: str, batch: TensorDict, **kwargs: Any) -> Any:
        """Shard ``batch`` by data-parallel rank, run ``role.<method>(shard, **kwargs)`` everywhere, gather.

        Returns:
            TensorDict results in the global batch's original order, or the first output rank's result for
            anything else (e.g. update metrics, which the roles already reduce over data-parallel ranks).

        Raises:
            BatchError: the batch does not split evenly over the data-parallel size.
        """
        return self._dispatch(
            method, self.topology, batch, lambda actor, shard: actor.call.remote(method, shard, **kwargs)
        )

    def compute_log_prob(self, batch: TensorDict, **kwargs: Any) -> TensorDict:
        """The actor's per-token log-probs (``calculate_entropy=True`` adds entropy) of the global batch."""
        return self.dispatch("compute_log_prob", batch, **kwargs)

    def update_policy(self, batch: TensorDict) -> dict[str, float]:
        """One actor update over the global batch; the metrics reduced over data-parallel ranks."""
        return self.dispatch("update_policy", batch)
