"""PPO through one colocated Ray worker group: a single controller drives actor, critic, reference and rollout.

As for ``drivetrain grpo`` (:mod:`drivetrain_roles.rl.controller`, the base both share): the driver holds the
prompts and the step logic of :mod:`.step` (:func:`.step.update_with`, the function the single-process trainer
calls too), the workers hold the engines (``actor``, ``critic``, ``reference`` when a KL term reads it) and the
rollouts. GAE, whitening and the KL statistics run on the driver over the whole batch; only token ids, log-probs,
values and metrics cross to it.

Example::

    config = load_config(None, ["model.path=/path/to/sft/final_model"])
    with ColocatedPPO.start(config, world_size=2, critic_dir="critic_start", num_cpus_per_worker=0.5) as ppo:
        for step, examples in enumerate(batches):
            metrics = ppo.step(step, examples)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, Self

from ..critic import CriticConfig
from ..jobs.data import Example
from ..rl.batch import RolloutBatch
from ..rl.controller import ColocatedController, policy_spec
from ..rl.scoring import answer_rewards
from ..rl.step_record import controller_record
from ..rm.export import write_value_model_start
from ..workers import ColocatedSpec, ColocatedWorkerGroup
from .config import PPOConfig
from .step import PPOCalls, scored_batch, update_with


def colocated_spec(config: PPOConfig, critic_dir: str | Path) -> ColocatedSpec:
    """The shared policy parts and rollout (and their refusals: the ``builtin:`` model, LoRA), with the
    reference when a KL term reads it, and the ``critic``: a value model started in ``critic_dir`` from
    ``model.path`` with a fresh head, on the actor's engine settings, with the actor's mini-batches.

    Raises:
        ConfigError: see :func:`drivetrain_roles.rl.controller.policy_spec`.
    """
    base = policy_spec(config, reference=config.algorithm.needs_reference)
    parts = dict(base.parts)
    actor = parts["actor"]
    start = write_value_model_start(actor.model_config.path, Path(critic_dir))
    parts["critic"] = dataclasses.replace(
        actor,
        role="critic",
        model_config=dataclasses.replace(actor.model_config, path=start, model_type="value_model", lora=None),
        optimizer_config=config.run_critic_optimizer(),
        role_config=CriticConfig(loss=config.algorithm.value_loss(), schedule=actor.role_config.schedule),
    )
    return ColocatedSpec(parts=parts, rollout=base.rollout)


class ColocatedPPO(ColocatedController):
    """The PPO step of :mod:`.step`, driven over a :class:`~..workers.ColocatedWorkerGroup`.

    Args:
        group: a colocated group with parts ``actor``, ``critic`` (and ``reference`` when a KL term reads it)
            and a rollout fed by the actor, e.g. from :func:`colocated_spec`.
        config: the run's configuration.
        tokenizer: decodes responses for the reward.
    """

    command = "PPO"
    config: PPOConfig

    def __init__(self, group: ColocatedWorkerGroup, config: PPOConfig, tokenizer: Any) -> None:
        super().__init__(group, config, tokenizer)
        self.kl_control = config.algorithm.kl_ctrl.controller()

    @classmethod
    def start(
        cls, config: PPOConfig, *, world_size: int, critic_dir: str | Path, **group_options: Any
    ) -> Self:
        """Start the group of :func:`colocated_spec` (``group_options`` go to the group) and the controller."""
        return cls._launch(
            config,
            lambda: colocated_spec(config, critic_dir),
            world_size=world_size,
            group_options=group_options,
        )

    def sample(self, step: int, examples: Sequence[Example]) -> RolloutBatch:
        """Sample ``examples`` on the workers' rollouts (:meth:`generate`) and score them on the driver."""
        output = self.generate(step, examples)
        _, scores = answer_rewards(examples, output, self.tokenizer, self.config.algorithm.rewards())
        return scored_batch(examples, output, scores, self.config)

    def update(self, samples: RolloutBatch, *, train_actor: bool = True) -> dict[str, float]:
        """Log-probs, values, GAE on the driver, the critic's update and (``train_actor``) the actor's."""
        call = self.group.call
        calls = PPOCalls(
            policy=self.policy_calls(),
            compute_values=partial(call, "critic", "compute_values"),
            update_critic=partial(call, "critic", "update_critic"),
        )
        algorithm = self.config.algorithm
        metrics, statistics = update_with(
            calls, samples, algorithm, self.kl_control.value, train_actor=train_actor
        )
        if "kl" in metrics:
            self.kl_control.update(metrics["kl"], n_steps=len(samples.rewards))
        return {**metrics, **statistics.metrics()}

    def step(self, step: int, examples: Sequence[Example]) -> dict[str, float]:
        """One PPO step (the actor frozen during ``trainer.critic_warmup``), then the hand-off of version
        ``step + 1`` inside every worker when the actor changed."""
        samples = self.sample(step, examples)
        train_actor = step >= self.config.trainer.critic_warmup
        metrics = self.update(samples, train_actor=train_actor)
        if train_actor:
            self.group.sync_rollout(step + 1)
        return controller_record(samples, metrics)


__all__ = ["ColocatedPPO", "colocated_spec"]
