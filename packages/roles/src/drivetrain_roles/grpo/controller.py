"""GRPO through one colocated Ray worker group: a single controller drives actor, reference and rollout.

The driver holds the prompts and the step logic of :mod:`.step`; the workers hold the engines and the
rollouts (:mod:`drivetrain_roles.rl.controller`). One step: every worker's rollout samples its data-parallel
slice of the prompts (whole groups per rank), the driver scores them (:func:`.step.score`), the actor and
reference parts recompute log-probs and the actor updates through the group's dispatch
(:func:`drivetrain_roles.rl.policy_update.update_with`, the function the single-process trainer calls too), then
every worker hands its actor's weights to its own rollout.

Example::

    config = load_config(None, ["model.path=/path/to/sft/final_model"])
    with ColocatedGRPO.start(config, world_size=2, num_cpus_per_worker=0.5) as grpo:
        for step, examples in enumerate(batches):
            metrics = grpo.step(step, examples)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from ..jobs.data import Example
from ..rl.batch import RolloutBatch
from ..rl.controller import ColocatedController, policy_spec
from ..rl.policy_update import update_with
from ..rl.step_record import controller_record
from ..workers import ColocatedSpec
from .config import GRPOConfig
from .step import score


def colocated_spec(config: GRPOConfig) -> ColocatedSpec:
    """The shared policy parts (:func:`drivetrain_roles.rl.controller.policy_spec`), with the reference when the
    KL penalty is on.

    Raises:
        ConfigError: see :func:`drivetrain_roles.rl.controller.policy_spec`.
    """
    return policy_spec(config, reference=config.algorithm.kl_loss_coef != 0)


class ColocatedGRPO(ColocatedController):
    """The GRPO step of :mod:`.step`, driven over a :class:`~..workers.ColocatedWorkerGroup`.

    Args:
        group: a colocated group with parts ``actor`` (and ``reference`` when the KL penalty is on) and a
            rollout fed by the actor, e.g. from :func:`colocated_spec`.
        config: the run's configuration.
        tokenizer: decodes responses for the reward.
    """

    command = "GRPO"
    config: GRPOConfig

    @classmethod
    def start(
        cls, config: GRPOConfig, *, world_size: int, spec: ColocatedSpec | None = None, **group_options: Any
    ) -> Self:
        """Start the group of ``spec`` (default :func:`colocated_spec`; ``group_options`` go to the group) and
        the controller."""
        return cls._launch(
            config, lambda: spec or colocated_spec(config), world_size=world_size, group_options=group_options
        )

    def sample(self, step: int, examples: Sequence[Example]) -> RolloutBatch:
        """Sample ``examples`` on the workers' rollouts (:meth:`generate`) and score them on the driver."""
        return score(examples, self.generate(step, examples), self.tokenizer, self.config)

    def update(self, samples: RolloutBatch) -> dict[str, float]:
        """Old and reference log-probs, one PPO-clip update: the actor's metrics, ``entropy`` and
        ``rollout/log_prob_diff_max`` (see :func:`~.step.update`)."""
        metrics, statistics = update_with(self.policy_calls(), samples)
        return {**metrics, **statistics.metrics()}

    def step(self, step: int, examples: Sequence[Example]) -> dict[str, float]:
        """One GRPO step over ``examples``, then the hand-off of version ``step + 1`` inside every worker."""
        samples = self.sample(step, examples)
        metrics = self.update(samples)
        self.group.sync_rollout(step + 1)
        return controller_record(samples, metrics)


__all__ = ["ColocatedGRPO", "colocated_spec"]
