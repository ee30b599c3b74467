"""DAPO's shaping of outcome rewards (Yu et al. 2025): the soft overlong penalty and the groups to filter out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .job_config import PolicyJobConfig


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each response's reward.

    0 up to ``max_length - buffer_length`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_length`` (verl's ``overlong_buffer``: ``len``, ``penalty_factor``; the maximum is the rollout's
    ``max_new_tokens``).

    Args:
        lengths: ``(responses,)`` tokens per response.
        max_length: the most tokens a response may have.
        buffer_length: how many tokens before ``max_length`` the penalty starts; 0 disables it.
        penalty_factor: the penalty at ``max_length``.
    """
    if buffer_length == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = lengths.float() - (max_length - buffer_length)
    return (-excess / buffer_length * penalty_factor).clamp(max=0.0)


def equal_reward_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(groups,)`` bool: where every reward of the group is the same (DAPO's dynamic sampling filters them: their
    group-relative advantages are 0, so they only dilute the batch)."""
    grouped = rewards.reshape(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def penalised_rewards(
    rewards: torch.Tensor, lengths: Sequence[int], config: PolicyJobConfig, *, max_length: int | None = None
) -> torch.Tensor:
    """``rewards`` plus :func:`overlong_penalty` of responses of ``lengths`` tokens, as ``algorithm``'s
    ``overlong_buffer_len`` and ``overlong_penalty_factor`` and ``max_length`` (default ``rollout.max_new_tokens``)
    set it."""
    algorithm = config.algorithm
    return rewards + overlong_penalty(
        torch.tensor(lengths),
        config.rollout.max_new_tokens if max_length is None else max_length,
        algorithm.overlong_buffer_len,
        algorithm.overlong_penalty_factor,
    )
