"""The Ray actors behind a worker group: start them, wait on them with a deadline, shut them down.

Every wait on a worker has a deadline and the first failing rank is reported by number, so a broken worker
never leaves the driver hanging. :class:`~.group.RayWorkerGroup` (one role) and
:class:`~.colocated_group.ColocatedWorkerGroup` (several parts and a rollout) build on it.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from drivetrain_engine_core.backend import DrivetrainError
from tensordict import TensorDict

from .dispatch import DispatchPlan, WorkerTopology

logger = logging.getLogger(__name__)

RAY_INSTALL_HINT = "pip install 'drivetrain-roles[ray]'"
SETTLE_S = 10.0
"""How long the other ranks of a failed call get to finish it before the group counts as broken."""


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


def cluster_shortfall(
    per_worker: Mapping[str, float], world_size: int, cluster: Mapping[str, float]
) -> str | None:
    """What a group's workers ask for in all beyond what the Ray cluster has now (CPUs, GPUs), or ``None``.

    Such a group waits for its last workers until the setup deadline and then reports the ranks as dead or stuck,
    unless the cluster grows (an autoscaler adds nodes), so a shortfall is warned about, not refused.
    """
    for resource, each in per_worker.items():
        needed, present = each * world_size, cluster.get(resource, 0.0)
        if needed > present + 1e-9:
            option = f"num_{resource.lower()}s_per_worker"
            return (
                f"{world_size} workers x {option}={each} need {needed:g} {resource}s, but the Ray cluster has "
                f"{present:g} (ray.cluster_resources()): unless it autoscales, the setup waits until timeout_s. "
                f"Lower {option} (fractions of a CPU are fine), use fewer workers, or add nodes."
            )
    return None


class GroupSpec(Protocol):
    """What a group's workers are set up from: a :class:`~.spec.WorkerSpec` or :class:`~.colocated.ColocatedSpec`."""

    @property
    def device(self) -> str:
        """The device type the workers' engines run on (``cuda`` asks Ray for a GPU per actor)."""
        ...

    @property
    def label(self) -> str:
        """What the workers build, for messages."""
        ...


SpecT = TypeVar("SpecT", bound=GroupSpec)


class RayActors(ABC, Generic[SpecT]):
    """One Ray actor per rank running :attr:`worker_cls`, set up by ``setup(spec, rank, world_size, master)``.

    Template method: the constructor checks the options, starts the actors, runs their setup and hands what it
    returned to the subclass's :meth:`_keep_setup`; if any of it fails, the actors are shut down again.

    Args:
        spec: what every worker builds.
        world_size: number of workers (ranks).
        num_cpus_per_worker: Ray CPU resources per actor (fractions such as 0.5 are fine).
        num_gpus_per_worker: Ray GPU resources per actor; default 1 on ``cuda``, else 0. A fraction is refused
            for more than one worker: Ray may place two ranks on one GPU, which NCCL refuses.
        timeout_s: deadline of every wait on the workers (setup and each call).
        balance: balanced (Karmarkar-Karp) sharding; else contiguous chunks.
        uneven: dispatch batches whose sequence (group) count the data-parallel size does not divide, in
            shards of unequal counts (the roles normalise by global counts, so the update is the same).

    A call that fails while other ranks are still running it (a rank raised and its peers did not finish within
    :data:`SETTLE_S`, or ranks did not answer in time) breaks the group: those ranks may be inside that call's
    collectives, where the next call's would pair with theirs. Later calls are refused; :meth:`shutdown` it and
    start a new group.

    Raises:
        ValueError: ``world_size`` below 1, ``timeout_s`` not positive, or a fractional GPU per worker for several
            workers.
        ImportError: Ray is not installed.
        WorkerGroupError: a worker failed to start or to set up (names the rank and the cause); a cluster with
            fewer CPUs or GPUs than the workers ask for in all is warned about first.
    """

    worker_cls: ClassVar[type]
    """The plain worker class each actor runs (wrapped with ``ray.remote`` here: it imports without Ray)."""

    def __init__(
        self,
        spec: SpecT,
        *,
        world_size: int,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float | None = None,
        timeout_s: float = 300.0,
        balance: bool = True,
        uneven: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"{type(self).__name__} world_size must be >= 1, got {world_size}.")
        if not timeout_s > 0:
            raise ValueError(f"{type(self).__name__} timeout_s must be > 0, got {timeout_s}.")
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1.0 if spec.device == "cuda" else 0.0
        if world_size > 1 and 0 < num_gpus_per_worker < 1:
            raise ValueError(
                f"{type(self).__name__} num_gpus_per_worker={num_gpus_per_worker} for {world_size} workers: Ray may "
                "place two ranks of the group on one GPU, which NCCL refuses. Give each worker a whole GPU; to share "
                "GPUs between roles, build them in one ColocatedWorkerGroup."
            )
        self._actors: list[Any] = []
        self._broken: str | None = None
        self._ray = require_ray()
        self.timeout_s = timeout_s
        self.balance, self.uneven = balance, uneven
        if self._ray.is_initialized():  # else the first actor starts a local Ray with every local CPU
            shortfall = cluster_shortfall(
                {"CPU": num_cpus_per_worker, "GPU": num_gpus_per_worker},
                world_size,
                self._ray.cluster_resources(),
            )
            if shortfall is not None:
                logger.warning("%s", shortfall)
        actor_cls = self._ray.remote(self.worker_cls).options(
            num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker
        )
        self._actors = [actor_cls.remote() for _ in range(world_size)]
        try:
            self._keep_setup(spec, self._setup(spec, world_size))
        except BaseException:
            self.shutdown()
            raise

    @abstractmethod
    def _keep_setup(self, spec: SpecT, results: list[Any]) -> None:
        """Keep ``spec`` and every worker's ``setup`` result (in rank order); raise if they are unusable."""

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self._actors)

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, in rank order (empty after :meth:`shutdown`)."""
        return list(self._actors)

    def _setup(self, spec: SpecT, world_size: int) -> list[Any]:
        local = len(self._ray.nodes()) == 1
        master = self._wait(
            [self._actors[0].rendezvous_address.remote(local)], "rendezvous_address", ranks=[0]
        )[0]
        refs = [
            actor.setup.remote(spec, rank=rank, world_size=world_size, master=master)
            for rank, actor in enumerate(self._actors)
        ]
        return self._wait(refs, f"setup of {spec.label}")

    def _wait(self, refs: Sequence[Any], what: str, ranks: Sequence[int] | None = None) -> list[Any]:
        """Results of ``refs`` (one per rank), failing on the first error or at the deadline.

        A failure breaks the group unless every rank has finished the call (failed or not) within
        :data:`SETTLE_S` of it: a rank that is still running may be inside the call's collectives.

        Raises:
            WorkerGroupError: a rank raised (its exception is chained), some ranks did not answer in time, or an
                earlier call broke the group.
        """
        if self._broken is not None:
            raise WorkerGroupError(
                f"{what}: this worker group is broken by an earlier failure ({self._broken}); its ranks may still be "
                "inside that call's collectives. shutdown() it and start a new group."
            )
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
                self._broken = f"{what}: ranks {late} did not answer"
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
                    failure = f"{what} failed on rank {rank_of[ref]}: {detail}"
                    if not self._settles(pending):
                        self._broken = failure
                    raise WorkerGroupError(failure) from e
        return [results[rank] for rank in ranks]

    def _settles(self, pending: Sequence[Any]) -> bool:
        """Whether the ranks still running a failed call finish it soon (all raising the same error before any
        collective, as a missing method does), which leaves the group usable."""
        if not pending:
            return True
        _, unfinished = self._ray.wait(
            list(pending), num_returns=len(pending), timeout=min(SETTLE_S, self.timeout_s)
        )
        return not unfinished

    def _dispatch(
        self,
        what: str,
        topology: Sequence[WorkerTopology],
        batch: TensorDict,
        submit: Callable[[Any, TensorDict], Any],
    ) -> Any:
        """Shard ``batch`` over ``topology``, ``submit(actor, shard)`` on every worker, gather the answers."""
        plan = DispatchPlan.for_batch(batch, topology, balance=self.balance, uneven=self.uneven)
        refs = [submit(actor, shard) for actor, shard in zip(self._actors, plan.shards(), strict=True)]
        return plan.gather(self._wait(refs, what))

    def shutdown(self) -> None:
        """Leave the process groups (best effort, bounded wait) and kill every actor; safe to call twice."""
        actors, self._actors = self._actors, []
        if not actors:
            return
        closing = [actor.close.remote() for actor in actors]
        self._ray.wait(closing, num_returns=len(closing), timeout=min(self.timeout_s, 5.0))
        for actor in actors:
            self._ray.kill(actor)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
