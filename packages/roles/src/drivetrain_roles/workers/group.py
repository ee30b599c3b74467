"""A driver-side group of Ray actors, one per rank, that run a role together as one torch.distributed job.

The driver creates the actors, lets rank 0 pick the rendezvous address, builds the role on every rank, then
dispatches global batches: each data-parallel rank gets its balanced shard (core's ``shard_indices``), every
worker runs the same role method, and the output ranks' answers are gathered back into the original order.
Every wait on a worker has a deadline and the first failing rank is reported by number, so a broken worker
never leaves the driver hanging.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from drivetrain_engine_core.errors import DrivetrainError
from tensordict import TensorDict

from .dispatch import DispatchPlan, WorkerTopology, check_topology
from .spec import WorkerSpec
from .worker import RoleWorker

RAY_INSTALL_HINT = "pip install 'drivetrain-roles[ray]'"


class WorkerGroupError(DrivetrainError, RuntimeError):
    """A worker of a group failed or did not answer in time."""


def require_ray() -> Any:
    """Import Ray, or fail with the command that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"the Ray worker group needs Ray, which is not installed; run {RAY_INSTALL_HINT}."
        ) from e
    return ray


class RayWorkerGroup:
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
        if world_size < 1:
            raise ValueError(f"RayWorkerGroup world_size must be >= 1, got {world_size}.")
        if not timeout_s > 0:
            raise ValueError(f"RayWorkerGroup timeout_s must be > 0, got {timeout_s}.")
        self._actors: list[Any] = []
        self._ray = require_ray()
        self.spec = spec
        self.timeout_s = timeout_s
        self.balance = balance
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1.0 if spec.engine_config.device == "cuda" else 0.0
        actor_cls = self._ray.remote(RoleWorker).options(
            num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker
        )
        self._actors = [actor_cls.remote() for _ in range(world_size)]
        try:
            self.topology = self._setup(world_size)
        except BaseException:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, in rank order (empty after :meth:`shutdown`)."""
        return list(self._actors)

    def _setup(self, world_size: int) -> list[WorkerTopology]:
        local = len(self._ray.nodes()) == 1
        master = self._wait(
            [self._actors[0].rendezvous_address.remote(local)], "rendezvous_address", ranks=[0]
        )[0]
        refs = [
            actor.setup.remote(self.spec, rank=rank, world_size=world_size, master=master)
            for rank, actor in enumerate(self._actors)
        ]
        topology = self._wait(refs, f"setup of role {self.spec.role!r}")
        check_topology(topology)
        return topology

    def _wait(self, refs: Sequence[Any], what: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """Results of ``refs`` (one per rank), failing on the first error or at the deadline.

        Raises:
            WorkerGroupError: a rank raised (its exception is chained) or some ranks did not answer in time.
        """
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        rank_of = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=max(remaining, 0.0))
            if not ready:
                late = sorted(rank_of[ref] for ref in pending)
                raise WorkerGroupError(
                    f"{what}: ranks {late} did not answer within timeout_s={self.timeout_s}; a peer may have "
                    "died or be stuck in a collective. Raise timeout_s for slow work, or shutdown() the group."
                )
            for ref in ready:
                try:
                    results[rank_of[ref]] = self._ray.get(ref)
                except Exception as e:
                    # A task error wraps the worker's own exception; name that, not Ray's remote traceback.
                    cause = getattr(e, "cause", None)
                    detail = (
                        f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(e)
                    )
                    raise WorkerGroupError(f"{what} failed on rank {rank_of[ref]}: {detail}") from e
        return [results[rank] for rank in ranks]

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
        plan = DispatchPlan.for_batch(batch, self.topology, balance=self.balance)
        shards = plan.shards(batch)
        refs = [
            actor.call.remote(method, shard, **kwargs)
            for actor, shard in zip(self._actors, shards, strict=True)
        ]
        return plan.gather(self._wait(refs, method))

    def compute_log_prob(self, batch: TensorDict, **kwargs: Any) -> TensorDict:
        """The actor's per-token log-probs (``calculate_entropy=True`` adds entropy) of the global batch."""
        return self.dispatch("compute_log_prob", batch, **kwargs)

    def update_policy(self, batch: TensorDict) -> dict[str, float]:
        """One actor update over the global batch; the metrics reduced over data-parallel ranks."""
        return self.dispatch("update_policy", batch)

    def shutdown(self) -> None:
        """Leave the process groups (best effort, bounded wait) and kill every actor; safe to call twice."""
        actors, self._actors = self._actors, []
        if not actors:
            return
        closing = [actor.close.remote() for actor in actors]
        self._ray.wait(closing, num_returns=len(closing), timeout=min(self.timeout_s, 5.0))
        for actor in actors:
            self._ray.kill(actor)

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
