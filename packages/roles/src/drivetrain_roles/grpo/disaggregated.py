"""GRPO with disaggregated placement: a trainer group and a rollout group on separate Ray workers.

The trainer group (:class:`~..workers.ColocatedWorkerGroup` with parts ``actor`` and ``reference``, no rollout)
updates; the rollout group (:class:`~..workers.RolloutWorkerGroup`) generates. The driver submits the batch of
step ``j`` as soon as the rollouts serve a version ``>= j - lag`` (``lag``: ``trainer.mode``'s, 0 in ``sync``),
so the rollouts generate while the trainer trains; after each update the trainer group streams the new version
to the rollouts, which take it after the batch in flight. The step logic is :mod:`.step`'s (the same
``rollout_batch`` and ``update_with`` as the colocated and single-process loops), with the per-token versions and
staleness bound of :mod:`drivetrain_roles.rl.versions`.

Example::

    config = load_config(None, ["model.path=/path/to/sft/final_model", "trainer.mode=one_step_off"])
    with DisaggregatedGRPO.start(config, trainer_workers=1, rollout_workers=1, num_cpus_per_worker=0.5) as grpo:
        records = grpo.train(lambda step: batches[step], steps=10)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

from ..jobs.data import Example
from ..rl.sampling import SEED_STRIDE, sampling_config
from ..rl.scoring import answer_rewards
from ..rl.step_record import controller_record
from ..rl.trainer_config import generation_lag
from ..rl.versions import Versions, staleness_metrics
from ..workers import RolloutGroupSpec, RolloutWorkerGroup
from .config import GRPOConfig
from .controller import ColocatedGRPO, colocated_spec
from .step import rollout_batch


class DisaggregatedGRPO:
    """The GRPO loop over a trainer group and a separate rollout group.

    Args:
        trainer: drives the trainer group's update (a :class:`.controller.ColocatedGRPO` whose group has no
            rollout).
        rollouts: the rollout group, serving ``version``.
        version: the weight version the rollouts serve (0: the model both groups loaded).
    """

    def __init__(self, trainer: ColocatedGRPO, rollouts: RolloutWorkerGroup, *, version: int = 0) -> None:
        self.trainer = trainer
        self.rollouts = rollouts
        self.version = version
        self.config: GRPOConfig = trainer.config

    @classmethod
    def start(
        cls, config: GRPOConfig, *, trainer_workers: int, rollout_workers: int, **group_options: Any
    ) -> Self:
        """Start both groups from :func:`.controller.colocated_spec` (``group_options`` go to each)."""
        spec = colocated_spec(config)
        rollout = spec.rollout
        if rollout is None:  # colocated_spec always builds one
            raise RuntimeError("colocated_spec built no rollout.")
        trainer = ColocatedGRPO.start(
            config, world_size=trainer_workers, spec=dataclasses.replace(spec, rollout=None), **group_options
        )
        try:
            rollouts = RolloutWorkerGroup(
                RolloutGroupSpec(rollout=rollout, device=config.engine.device),
                world_size=rollout_workers,
                **group_options,
            )
        except BaseException:
            trainer.shutdown()
            raise
        return cls(trainer, rollouts)

    def train(self, examples_of: Callable[[int], Sequence[Example]], steps: int) -> list[dict[str, float]]:
        """Steps ``version .. version + steps - 1``, each on ``examples_of(step)``'s prompts (a function of the
        step alone); returns each step's metrics.

        Raises:
            WorkerGroupError: a trainer or rollout worker failed or died (named with its rank and the call).
        """
        lag = generation_lag(self.config.trainer) or 0
        first, last = self.version, self.version + steps
        pending: dict[int, tuple[list[Any], int]] = {}

        def submit_ready() -> None:
            step = max(pending, default=first - 1) + 1
            while step < last and step - self.version <= lag:
                pending[step] = (self._submit(step, examples_of(step)), self.version)
                step += 1

        records = []
        for step in range(first, last):
            submit_ready()
            records.append(self._step(step, examples_of(step), *pending.pop(step), lag))
        return records

    def _submit(self, step: int, examples: Sequence[Example]) -> list[Any]:
        seed = self.config.trainer.seed + SEED_STRIDE * step
        return self.rollouts.submit([e.prompt_ids for e in examples], sampling_config(self.config, seed=seed))

    def _step(
        self, step: int, examples: Sequence[Example], refs: list[Any], version: int, lag: int
    ) -> dict[str, float]:
        started = time.perf_counter()
        output, generating = self.rollouts.collect(refs, self.config.rollout.n)
        taken = time.perf_counter()
        versions = Versions.of(output, version, current=step, max_staleness=lag)
        _, scores = answer_rewards(examples, output, self.trainer.tokenizer, self.config.algorithm.rewards())
        samples = rollout_batch(examples, output, scores.total, self.config, versions=versions, scores=scores)
        metrics = self.trainer.update(samples)
        bucket_mb = self.config.rollout.bucket_mb
        self.version = self.rollouts.receive(
            lambda actors, base: self.trainer.group.send_weights(
                "actor", step + 1, actors, bucket_mb=bucket_mb, base_version=base
            )
        )
        ended = time.perf_counter()
        waited = taken - started
        return {
            **controller_record(samples, metrics),
            **staleness_metrics(versions, dropped_sequences=samples.dropped_groups * output.n),
            "perf/wait_s": waited,
            "perf/generating_s": generating,
            "perf/training_s": ended - taken,
            # Generation the trainer did not wait for ran beside its earlier work.
            "perf/overlapped_s": max(0.0, generating - waited),
        }

    def shutdown(self) -> None:
        try:
            self.rollouts.shutdown()
        finally:
            self.trainer.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
