"""The actor's role config of an RL command, shared by its trainer and its single controller."""

from __future__ import annotations

from ..actor import ActorConfig
from ..mini_batches import UpdateSchedule
from .job_config import PolicyJobConfig


def actor_config(config: PolicyJobConfig) -> ActorConfig:
    """The actor: ``algorithm.loss_mode``'s loss with the KL penalty, ``algorithm.ppo_mini_batches``
    optimizer steps per pass over a rollout, ``algorithm.ppo_epochs`` passes (1 and 1: on-policy GRPO)."""
    algorithm = config.algorithm
    loss = algorithm.policy_loss(max_new_tokens=config.rollout.max_new_tokens)
    sequences = config.trainer.prompts_per_step * config.rollout.n
    schedule = UpdateSchedule(
        mini_batch_size=-(-sequences // algorithm.ppo_mini_batches),
        epochs=algorithm.ppo_epochs,
        shuffle=algorithm.ppo_mini_batches > 1 or algorithm.ppo_epochs > 1,
        seed=config.trainer.seed,
    )
    return ActorConfig(loss=loss, schedule=schedule, temperature=config.rollout.temperature)
