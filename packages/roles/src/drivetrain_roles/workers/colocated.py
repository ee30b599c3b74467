"""Colocated workers: every rank builds several named parts (actor, reference, ...) and a rollout in one world.

One Ray actor per rank joins one torch.distributed world and builds every part of a :class:`ColocatedSpec`
there (engines of the same world, the same devices), plus a rollout. Calls name the part. The worker switches
phases itself: before a part runs, the rollout sleeps (its device memory is freed); the engines load and
offload their state inside their own ``train_mode``/``eval_mode`` (``engine.param_offload`` /
``optimizer_offload``); before generating, the rollout wakes. The weight hand-off runs inside each worker, from
the ``weights_from`` part's engine to the local rollout, so no weights travel through the driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from drivetrain_engine_core.rollout import Rollout, RolloutOptions, RolloutOutput, SamplingConfig

from .dispatch import WorkerTopology
from .spec import WorkerSpec
from .worker import RoleWorker, build_role, join_world, role_method


@dataclass(kw_only=True, frozen=True)
class RolloutSpec:
    """The rollout each colocated worker builds next to its parts.

    Attributes:
        name: a registered rollout (``hf``, or a plugin's).
        model_path: the Hugging Face model directory it serves (its architecture and first weights).
        weights_from: the part whose engine hands its weights to the rollout.
        bucket_mb: most MiB per weight bucket of a hand-off.
        options: the rollout's own options by key (a job's ``rollout.options``), built and checked by core's
            ``create_rollout`` against the rollout's declared options, or already built.
    """

    name: str = "hf"
    model_path: str
    weights_from: str = "actor"
    bucket_mb: float = 64.0
    options: Mapping[str, Any] | RolloutOptions = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"RolloutSpec.bucket_mb must be > 0, got {self.bucket_mb}.")


@dataclass(kw_only=True, frozen=True)
class ColocatedSpec:
    """What every worker of a :class:`~.colocated_group.ColocatedWorkerGroup` builds, in one world.

    Attributes:
        parts: part name -> the role and engine to build (e.g. ``{"actor": ..., "reference": ...}``). All
            parts run on one device type; the first part's ``cpu_threads`` and the largest ``timeout_s`` set
            up the process group.
        rollout: the rollout next to the parts (``None``: parts only).
    """

    parts: Mapping[str, WorkerSpec]
    rollout: RolloutSpec | None = None

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(
                "ColocatedSpec.parts is empty; name at least one part, e.g. {'actor': WorkerSpec(...)}."
            )
        devices = {name: part.engine_config.device for name, part in self.parts.items()}
        if len(set(devices.values())) != 1:
            raise ValueError(
                f"ColocatedSpec parts must share one device type to share a world, got {devices}."
            )
        if self.rollout is not None and self.rollout.weights_from not in self.parts:
            raise ValueError(
                f"ColocatedSpec.rollout.weights_from={self.rollout.weights_from!r} is not a part; "
                f"choose one of {list(self.parts)}."
            )

    @property
    def device(self) -> str:
        """The device type every part's engine runs on."""
        return next(iter(self.parts.values())).engine_config.device

    @property
    def label(self) -> str:
        """What the group builds, for messages."""
        return f"parts {list(self.parts)}" + (
            "" if self.rollout is None else f" + rollout {self.rollout.name!r}"
        )

    def world_spec(self) -> WorkerSpec:
        """The part whose settings join the world (the first), with the largest process-group timeout."""
        first = next(iter(self.parts.values()))
        timeout_s = max(part.timeout_s for part in self.parts.values())
        return WorkerSpec(**{**first.__dict__, "timeout_s": timeout_s})


class ColocatedWorker(RoleWorker):
    """One rank of a colocated group: every part's role and a rollout, switched by phase."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: dict[str, Any] = {}
        self.rollout: Rollout | None = None
        self.spec: ColocatedSpec | None = None

    def setup(  # type: ignore[override]
        self, spec: ColocatedSpec, *, rank: int, world_size: int, master: tuple[str, int]
    ) -> dict[str, WorkerTopology]:
        """Join one world, build every part in it and the rollout (asleep until it is needed).

        Returns:
            Each part's place in the data-parallel layout.
        """
        from drivetrain_engine_core.job import create_rollout

        join_world(spec.world_spec(), rank=rank, world_size=world_size, master=master)
        self.rank, self.spec = rank, spec
        topologies = {}
        for name, part in spec.parts.items():
            self.parts[name], topologies[name] = build_role(part, rank)
        if spec.rollout is not None:
            self.rollout = create_rollout(
                spec.rollout.name,
                model_path=spec.rollout.model_path,
                device=spec.device,
                options=spec.rollout.options,
            )
            self.rollout.sleep()
        return topologies

    def call(self, part: str, method: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run ``<part>.<method>(*args, **kwargs)`` with the rollout asleep.

        Raises:
            KeyError: no such part (names the parts); AttributeError: the part's role has no such method.
        """
        target = role_method(self._part(part), method, self.rank)
        if self.rollout is not None:
            self.rollout.sleep()
        return target(*args, **kwargs)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutOutput:
        """Wake the rollout (the engines sit offloaded outside their calls) and sample with it."""
        return self._awake_rollout().generate(prompts, sampling)

    def sync_rollout(self, version: int) -> int:
        """Hand the ``weights_from`` part's weights to the local rollout as ``version`` (a collective).

        The engine holds its parameters on the device for the stream (``eval_mode`` loads offloaded ones and
        offloads them again after), so the hand-off never leaves the worker. It is a delta on the version the
        rollout serves intact (the full version otherwise).
        """
        rollout = self._awake_rollout()
        spec = self.rollout_spec
        engine = self._part(spec.weights_from).engine
        with engine.eval_mode():
            buckets = engine.weight_buckets(
                version=version, bucket_bytes=int(spec.bucket_mb * 2**20), base_version=rollout.delta_base
            )
            return rollout.update_weights(buckets)

    def send_weights(
        self, part: str, version: int, receivers: list[Any], *, bucket_mb: float, base_version: int | None
    ) -> None:
        """Stream ``part``'s weights as ``version`` (a collective over this group) to rollouts on other workers:
        rank 0 forwards each bucket to every ``receivers`` actor (``RolloutWorker.push``) and waits for them to
        take it, so one bucket at a time is in flight (disaggregated placement).

        NOTE: rank 0 keeps iterating after a receiver fails, so the other ranks' collectives complete; it raises
        the first failure at the end.
        """
        import ray

        engine = self._part(part).engine
        failure: BaseException | None = None
        with engine.eval_mode():
            buckets = engine.weight_buckets(
                version=version, bucket_bytes=int(bucket_mb * 2**20), base_version=base_version
            )
            for bucket in buckets:
                if self.rank == 0 and failure is None:
                    try:
                        ray.get([receiver.push.remote(bucket) for receiver in receivers])
                    except Exception as e:
                        failure = e
        if failure is not None:
            raise failure

    def state(self) -> dict[str, Any]:
        """The rollout's state: ``{"rollout_asleep", "rollout_version"}`` (both ``None`` without a rollout)."""
        if self.rollout is None:
            return {"rollout_asleep": None, "rollout_version": None}
        return {"rollout_asleep": self.rollout.asleep, "rollout_version": self.rollout.weights_version}

    @property
    def rollout_spec(self) -> RolloutSpec:
        if self.spec is None or self.spec.rollout is None:
            raise RuntimeError(f"rank {self.rank}: this group has no rollout; set ColocatedSpec.rollout.")
        return self.spec.rollout

    def _part(self, name: str) -> Any:
        if name not in self.parts:
            raise KeyError(f"rank {self.rank}: no part {name!r}; this group has parts {list(self.parts)}.")
        return self.parts[name]

    def _awake_rollout(self) -> Rollout:
        if self.rollout is None:
            raise RuntimeError(f"rank {self.rank}: this group has no rollout; set ColocatedSpec.rollout.")
        self.rollout.wake()
        return self.rollout
