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


class RayWorkerGroup(RayActors[WorkerSpec]):
    """``world_size`` Ray actors that each build ``spec``'s engine and role and run as one distributed job.

    ``spec`` is the role and engine configs every worker builds; the other arguments, and what a failed
    start raises (a :class:`WorkerGroupError` names the rank and the cause), are :class:`~.actors.RayActors`'.
    """

    worker_cls = RoleWorker
    spec: WorkerSpec
    topology: list[WorkerTopology]

    def _keep_setup(self, spec: WorkerSpec, results: list[Any]) -> None:
        check_topology(results)
        self.spec = spec
        self.topology = results

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

    def update_policy(self, batch: TensorDict, objective: Any = None) -> dict[str, float]:
        """One actor update over the global batch (PPO's, or ``objective``, an ``actor.PolicyObjective`` whose
        loss function pickles: a module-level function); the metrics reduced over data-parallel ranks."""
        return self.dispatch("update_policy", batch, objective=objective)
