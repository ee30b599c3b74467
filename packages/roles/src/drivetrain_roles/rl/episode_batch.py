"""A step's episodes as the actor trains on them: the trajectory batch (:mod:`drivetrain_roles.rollout.
trajectory`) with the rewards of both sources, and only the model's tokens in the loss.

An episode's reward is the environment's (the sum of its turn rewards) plus ``extra``: the configured reward
functions' score of its final model turn, with the overlong penalty when on (DAPO's, over the episode's model
tokens against ``environment.max_total_tokens``). ``token_rewards`` (what PPO's GAE takes) holds each turn's
environment reward at that turn's last token and ``extra`` at the episode's last model token, so it sums to the
episode's reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from ..rollout.trajectory import Trajectory, trajectory_batch
from .batch import RolloutBatch, jagged
from .job_config import PolicyJobConfig
from .reward_shaping import penalised_rewards
from .rewards import Scores


def model_token_counts(trajectories: Sequence[Trajectory]) -> list[int]:
    """How many model tokens each episode has (its ``loss_mask``'s)."""
    return [int(t.loss_mask.sum()) for t in trajectories]


def extra_rewards(
    trajectories: Sequence[Trajectory], function_scores: torch.Tensor, config: PolicyJobConfig
) -> torch.Tensor:
    """``(episodes,)`` what is added to the environment's reward: the reward functions' score of the final turn
    and the overlong penalty over the episode's model tokens."""
    counts = model_token_counts(trajectories)
    return penalised_rewards(function_scores, counts, config, max_length=config.environment.max_total_tokens)


def episode_batch(
    trajectories: Sequence[Trajectory], extra: torch.Tensor, keep: torch.Tensor
) -> tuple[TensorDict, torch.Tensor]:
    """The no-padding batch of ``trajectories`` whose loss mask holds the model tokens of the ``keep`` episodes,
    and each episode's reward (environment + ``extra``)."""
    batch = trajectory_batch(trajectories)
    lengths = batch["input_ids"].offsets().diff()
    batch["loss_mask"] = jagged([batch["loss_mask"].values() & keep.bool().repeat_interleave(lengths)], batch)
    token_rewards = batch["token_rewards"].values().clone()
    for start, trajectory, value in zip(
        batch["input_ids"].offsets().tolist(), trajectories, extra.tolist(), strict=False
    ):
        if trajectory.turn_spans:
            token_rewards[start + trajectory.turn_spans[-1][1] - 1] += value
    batch["token_rewards"] = jagged([token_rewards], batch)
    rewards = batch["rewards"] + extra.float()
    batch["rewards"] = rewards
    return batch, rewards


def model_log_probs(trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
    """Each episode's sampled log-probs of its model tokens (what the actor's recomputation is compared with at
    the loss mask's positions)."""
    return [t.log_probs[t.loss_mask] for t in trajectories]


def episodes_rollout_batch(
    trajectories: Sequence[Trajectory],
    batch: TensorDict,
    rewards: torch.Tensor,
    scores: Scores,
    **fields: Any,
) -> RolloutBatch:
    """The step's :class:`~.batch.RolloutBatch` of ``trajectories`` (their :func:`episode_batch` and rewards):
    the sampled log-probs and lengths of their model tokens; ``fields``: the command's own (GRPO's filtered and
    stale groups)."""
    return RolloutBatch(
        batch=batch,
        rollout_log_probs=model_log_probs(trajectories),
        rewards=rewards,
        response_lengths=model_token_counts(trajectories),
        scores=scores,
        **fields,
    )
