"""Disaggregated placement: rollouts on their own Ray workers, fed weights by a separate trainer group.

A :class:`RolloutWorkerGroup` starts one actor per rollout (no torch.distributed world: each rollout samples
its share of the prompts alone). Its weights come from a trainer group (a
:class:`~.colocated_group.ColocatedWorkerGroup` built without a rollout): every trainer rank streams its
engine's buckets (a collective) and rank 0 forwards each bucket to every rollout worker, which applies it as it
arrives (at most one bucket waiting per worker). A Ray actor runs one call at a time, so a hand-off that
reaches a rollout while it generates waits for the batch in flight (``hf`` finishes it, then takes the new
version). Generation can be submitted without waiting (:meth:`RolloutWorkerGroup.submit`), which is how the
driver overlaps it with training.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig, WeightBucket

from .actors import RayActors
from .colocated import RolloutSpec
from .dispatch import WorkerTopology
from .generation import merged_output, prompt_shards
from .worker import RoleWorker

POLL_S = 1.0
"""How often a forwarded bucket checks that the rollout still applies the stream."""


@dataclass(kw_only=True, frozen=True)
class RolloutGroupSpec:
    """What each worker of a :class:`RolloutWorkerGroup` builds.

    Attributes:
        rollout: the rollout (its ``weights_from`` names the trainer group's part that feeds it).
        device: the device type it generates on.
    """

    rollout: RolloutSpec
    device: str = "cpu"

    @property
    def label(self) -> str:
        return f"rollout {self.rollout.name!r}"


class RolloutWorker(RoleWorker):
    """One rollout on its own worker: generates, and applies weight streams forwarded by the trainer."""

    def setup(  # type: ignore[override]
        self, spec: RolloutGroupSpec, *, rank: int, world_size: int, master: tuple[str, int]
    ) -> WorkerTopology:
        """Build the rollout (no process group: it samples alone). Returns its place among the rollouts."""
        from drivetrain_engine_core.job import create_rollout

        del master  # nothing to join
        self.rank = rank
        self.rollout: Rollout = create_rollout(
            spec.rollout.name,
            model_path=spec.rollout.model_path,
            device=spec.device,
            options=spec.rollout.options,
        )
        self._stream: _Stream | None = None
        return WorkerTopology(rank=rank, dp_rank=rank, dp_size=world_size, is_output_rank=True)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> tuple[RolloutOutput, float]:
        """Sample; returns the output and the seconds it took."""
        started = time.perf_counter()
        output = self.rollout.generate(prompts, sampling)
        return output, time.perf_counter() - started

    def delta_base(self) -> int | None:
        """The version a delta stream may build on (see :attr:`Rollout.delta_base`)."""
        return self.rollout.delta_base

    def begin_update(self) -> None:
        """Start applying a stream whose buckets :meth:`push` brings."""
        self._stream = _Stream(self.rollout.update_weights)

    def push(self, bucket: WeightBucket) -> None:
        """Hand one bucket to the stream (waits while the previous one is still waiting)."""
        self._require_stream().put(bucket)

    def end_update(self) -> int:
        """Finish the stream; returns the version now served (raises what applying it raised)."""
        stream, self._stream = self._require_stream(), None
        return stream.finish()

    def _require_stream(self) -> _Stream:
        if self._stream is None:
            raise RuntimeError(f"rollout worker {self.rank}: no weight stream; call begin_update() first.")
        return self._stream


class _Stream:
    """A weight stream applied on a thread as its buckets arrive (``Rollout.update_weights`` pulls them)."""

    def __init__(self, apply: Callable[[Iterator[WeightBucket]], int]) -> None:
        self._buckets: queue.Queue[WeightBucket | None] = queue.Queue(maxsize=1)
        self._version: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(apply,), daemon=True)
        self._thread.start()

    def put(self, bucket: WeightBucket | None) -> None:
        while True:
            self._raise_if_stopped()
            try:
                self._buckets.put(bucket, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def finish(self) -> int:
        if self._thread.is_alive():
            self.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._version is None:
            raise RuntimeError("the weight stream ended without a version.")
        return self._version

    def _raise_if_stopped(self) -> None:
        if not self._thread.is_alive():
            if self._error is not None:
                raise self._error
            raise RuntimeError("the weight stream ended before its last bucket was forwarded.")

    def _run(self, apply: Callable[[Iterator[WeightBucket]], int]) -> None:
        try:
            self._version = apply(iter(self._buckets.get, None))
        except BaseException as e:  # raised again by the next put() or finish()
            self._error = e


class RolloutWorkerGroup(RayActors[RolloutGroupSpec]):
    """``world_size`` Ray actors that each serve one rollout of ``spec``; constructed like the other groups
    (:class:`~.actors.RayActors`' arguments). Failures name the rollout worker and the call."""

    worker_cls = RolloutWorker
    topology: list[WorkerTopology]

    def _keep_setup(self, spec: RolloutGroupSpec, results: list[Any]) -> None:
        self.spec = spec
        self.topology = list(results)

    def submit(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Any]:
        """Start generating ``sampling.n`` responses per prompt over the workers (prompts split as in
        :func:`~.generation.prompt_shards`); :meth:`collect` waits for them."""
        shards = prompt_shards(prompts, sampling, self.topology)
        return [actor.generate.remote(*shard) for actor, shard in zip(self._actors, shards, strict=True)]

    def collect(self, refs: list[Any], n: int) -> tuple[RolloutOutput, float]:
        """The submitted generation's output and its longest worker's seconds.

        Raises:
            WorkerGroupError: a rollout worker failed or died (``rollout.generate failed on rank R: ...``), did
                not answer within ``timeout_s``, or the workers served different versions.
        """
        answers = self._wait(refs, "rollout.generate")
        return merged_output([a[0] for a in answers], self.topology, n), max(a[1] for a in answers)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutOutput:
        """:meth:`submit` then :meth:`collect`."""
        return self.collect(self.submit(prompts, sampling), sampling.n)[0]

    def delta_base(self) -> int | None:
        """The version every rollout holds intact (a delta's base), or ``None`` when they differ."""
        bases = set(self._wait([a.delta_base.remote() for a in self._actors], "rollout.delta_base"))
        return bases.pop() if len(bases) == 1 else None

    def receive(self, send: Callable[[list[Any], int | None], Any]) -> int:
        """Apply one weight stream on every rollout: ``send(actors, base_version)`` makes the trainer group
        forward its buckets to ``actors`` (see ``ColocatedWorkerGroup.send_weights``). Returns the version now
        served.
        """
        base = self.delta_base()
        self._wait([a.begin_update.remote() for a in self._actors], "rollout.begin_update")
        try:
            send(self.actors, base)
        except BaseException:
            # NOTE: end the streams short: each rollout then refuses to generate until a complete version
            # arrives (a partial stream is never served), and the next stream starts clean.
            self._ray.wait([a.end_update.remote() for a in self._actors], num_returns=len(self._actors))
            raise
        versions = self._wait([a.end_update.remote() for a in self._actors], "rollout.update_weights")
        return int(versions[0])
