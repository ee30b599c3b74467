"""The GRPO training loop over any installed engine backend and rollout.

The job is :class:`~drivetrain_roles.rl.policy_trainer.PolicyTrainer` (setup; each step: sample, score, update,
hand off; evaluation, checkpoints, the final model); GRPO fills in its own: the batch (the group filter, the
samples too stale for ``trainer.max_staleness``, the critic-free advantages: :mod:`.step`), one PPO-clip update
with the KL loss, and the step's timing and staleness metrics. ``trainer.mode`` says whether the samples come
from the step's own weights or from a rollout thread generating ahead (:mod:`drivetrain_roles.rl.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..jobs.data import Example
from ..rl.batch import RolloutBatch
from ..rl.pipeline import GeneratedBatch
from ..rl.policy_trainer import PolicyJobResult, PolicyTrainer, StepTiming
from ..rl.rewards import Scores
from ..rl.step_record import StepRecord
from ..rl.versions import staleness_metrics
from ..update_metrics import ENGINE_LOSS_METRICS
from .config import GRPOConfig
from .step import generated_batch, update


@dataclass
class GRPOResult(PolicyJobResult):
    """What a GRPO run did, on every rank (see :class:`~drivetrain_roles.rl.policy_trainer.PolicyJobResult`)."""


class GRPOTrainer(PolicyTrainer[GRPOConfig]):
    """Group-relative policy optimisation with an exact-answer reward.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.grpo.config.load_config`).
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints``.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over.
    """

    command = "grpo"
    result_type = GRPOResult

    def _uses_reference(self) -> bool:
        """Whether a KL term reads the reference's log-probs (GRPO: the KL loss)."""
        return self.config.algorithm.kl_loss_coef != 0

    def _batch(
        self, step: int, examples: list[Example], generated: GeneratedBatch, scores: Scores
    ) -> RolloutBatch:
        group = self.actor.engine.data_parallel_group
        return generated_batch(examples, generated, scores, self.config, group, step=step)

    def _update(self, step: int, samples: RolloutBatch) -> dict[str, float]:
        return update(self.actor, self.reference, samples)

    def _command_metrics(
        self, record: StepRecord, samples: RolloutBatch, timing: StepTiming, result: PolicyJobResult
    ) -> dict[str, float]:
        """The step's timing, the engine's loss terms, the filtered groups and (asynchronous modes) the
        staleness of its samples."""
        config, update = self.config, record.update
        spent = {
            "generating": timing.generating,
            "training": timing.training,
            "overlapped": timing.overlapped,
        }
        for name, value in spent.items():
            result.timing[name] += value
        values = {
            "perf/wait_s": timing.wait,
            **{f"perf/{name}_s": value for name, value in spent.items()},
            **{f"train/{name}": update[name] for name in ENGINE_LOSS_METRICS if name in update},
        }
        if config.trainer.mode != "sync" and samples.versions is not None:
            group = self.actor.engine.data_parallel_group
            dropped = samples.dropped_groups * config.rollout.n
            staleness = staleness_metrics(samples.versions, dropped_sequences=dropped, group=group)
            values.update(staleness)
            result.dropped_samples += int(staleness["async/dropped_samples"])
        if config.algorithm.filter_groups:
            totals = record.totals
            values["train/filtered_group_fraction"] = totals.filtered_groups * config.rollout.n / totals.count
        return values
