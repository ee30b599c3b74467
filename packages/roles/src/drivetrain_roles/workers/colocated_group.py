"""The driver side of a colocated group: one set of Ray actors serving every part and a rollout.

Unlike one :class:`~.group.RayWorkerGroup` per role, a :class:`ColocatedWorkerGroup` starts one actor per rank
and every actor builds all parts of a :class:`~.colocated.ColocatedSpec` in one torch.distributed world. Batch
calls name the part and use the same dispatch (shard by the part's data-parallel rank, gather from its output
ranks); generation shards prompts by data-parallel rank; the weight hand-off runs inside every worker. Every
wait has the group's deadline, and a failure names the rank and the part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from drivetrain_engine_core.rollout import RolloutOutput, SamplingConfig
from tensordict import TensorDict

from .actors import RayActors
from .colocated import ColocatedSpec, ColocatedWorker
from .dispatch import WorkerTopology, check_topology
from .generation import merged_output, prompt_shards


class ColocatedWorkerGroup(RayActors[ColocatedSpec]):
    """``world_size`` Ray actors that each build every part of ``spec`` (and its rollout) in one world.

    Constructed like :class:`~.group.RayWorkerGroup` (:class:`~.actors.RayActors`' arguments), from a
    :class:`~.colocated.ColocatedSpec`; a part that fails to build is named with its rank.
    """

    worker_cls = ColocatedWorker
    colocated: ColocatedSpec
    topologies: dict[str, list[WorkerTopology]]
    topology: list[WorkerTopology]

    def _keep_setup(self, spec: ColocatedSpec, results: list[Any]) -> None:
        topologies = {name: [result[name] for result in results] for name in spec.parts}
        for topology in topologies.values():
            check_topology(topology)
        self.colocated = spec
        self.topologies = topologies
        first = next(iter(spec.parts))
        self.topology = topologies[spec.rollout.weights_from if spec.rollout else first]

    def call(self, part: str, method: str, batch: TensorDict, **kwargs: Any) -> Any:
        """Shard ``batch`` by ``part``'s data-parallel ranks, run ``<part>.<method>(shard, **kwargs)``, gather.

        Raises:
            KeyError: no such part.
            WorkerGroupError: a rank failed or did not answer (``"<part>.<method> failed on rank R: ..."``).
        """
        return self._dispatch(
            f"{part}.{method}",
            self._topology(part),
            batch,
            lambda actor, shard: actor.call.remote(part, method, shard, **kwargs),
        )

    def call_all(self, part: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``<part>.<method>(*args, **kwargs)`` on every worker with the same arguments; one result each."""
        refs = [actor.call.remote(part, method, *args, **kwargs) for actor in self._actors]
        return self._wait(refs, f"{part}.{method}")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutOutput:
        """Sample ``sampling.n`` responses per prompt with every worker's rollout.

        Contiguous equal slices of ``prompts`` go to the data-parallel ranks (whole groups stay on one rank);
        rank ``d`` samples with seed ``sampling.seed + d``. The answer is prompt-major, in ``prompts``' order.

        Raises:
            BatchError: the prompts do not split evenly over the data-parallel ranks.
            WorkerGroupError: a rank failed, or the ranks served different weight versions.
        """
        shards = prompt_shards(prompts, sampling, self.topology)
        refs = [actor.generate.remote(*shard) for actor, shard in zip(self._actors, shards, strict=True)]
        return merged_output(self._wait(refs, "rollout.generate"), self.topology, sampling.n)

    def sync_rollout(self, version: int) -> int:
        """Every worker streams its ``weights_from`` part's weights to its own rollout as ``version``.

        Returns:
            The version now served on every worker.
        """
        versions = self._wait([actor.sync_rollout.remote(version) for actor in self._actors], "rollout.sync")
        return int(versions[0])

    def send_weights(
        self, part: str, version: int, receivers: list[Any], *, bucket_mb: float, base_version: int | None
    ) -> None:
        """Every worker streams ``part``'s weights as ``version``; rank 0 forwards them to ``receivers`` (the
        actors of a :class:`~.rollout_group.RolloutWorkerGroup`, through its ``receive``)."""
        self._wait(
            [
                actor.send_weights.remote(
                    part, version, receivers, bucket_mb=bucket_mb, base_version=base_version
                )
                for actor in self._actors
            ],
            "rollout.send_weights",
        )

    def states(self) -> list[dict[str, Any]]:
        """Each worker's rollout state (``rollout_asleep``, ``rollout_version``), in rank order."""
        return self._wait([actor.state.remote() for actor in self._actors], "state")

    def _topology(self, part: str) -> list[WorkerTopology]:
        if part not in self.topologies:
            raise KeyError(f"no part {part!r}; this group has parts {list(self.topologies)}.")
        return self.topologies[part]
