"""Critic-free advantage estimators chosen by name (verl's ``algorithm.adv_estimator``), from one score per response.

The responses come in groups of ``group_size`` (the samples of one prompt, group-major). Per response ``i`` of
a group with scores ``R_1 .. R_n`` (mean ``m``, unbiased standard deviation ``s``):

- ``grpo``: ``(R_i - m) / (s + epsilon)`` (Shao et al. 2024); with ``scale_by_std=false`` ``R_i - m``.
- ``dr_grpo``: ``R_i - m`` (Liu et al. 2025: the division by ``s`` favours prompts whose rewards barely differ).
- ``rloo``: ``R_i - mean of the other n - 1`` ``= n / (n - 1) * (R_i - m)`` (Ahmadian et al. 2024).
- ``reinforce_plus_plus``: per token the discounted return of the score (placed on the response's last loss
  token), ``gamma^(later loss tokens) * R_i``, whitened over every loss token of the batch (Hu 2025).
- ``reinforce_plus_plus_baseline``: ``R_i - m`` on every loss token, whitened over every loss token of the batch.

``gae`` is known too, but needs a critic's values: :func:`~drivetrain_roles.advantages.compute_gae`. The results
are jagged per-token advantages, 0 off the loss tokens; whitening reduces over ``group`` (the data-parallel
group, so that every rank uses the statistics of the global batch, as verl's single controller does).
"""

from __future__ import annotations

import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import jagged
from torch.distributed import ProcessGroup

from ..advantages import whiten
from ..losses.aggregation import FlatTokens
from .advantage_config import ADV_ESTIMATORS as ADV_ESTIMATORS  # importable from here since 0.1.0
from .advantage_config import CRITIC_ESTIMATORS as CRITIC_ESTIMATORS  # importable from here since 0.1.0
from .advantage_config import OUTCOME_ESTIMATORS as OUTCOME_ESTIMATORS  # importable from here since 0.1.0
from .advantage_config import AdvantageConfig

_WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def group_advantages(
    rewards: torch.Tensor, group_size: int, epsilon: float = 1e-6, *, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO's outcome advantage: each reward minus its group's mean, over the group's standard deviation.

    Args:
        rewards: ``(groups * group_size,)`` rewards, group-major (the ``n`` responses of a prompt together).
        group_size: responses per prompt.
        epsilon: added to the (unbiased) standard deviation; a group whose rewards are all equal gets exactly 0
            (statistics in float64, whatever the rewards' dtype).
        scale_by_std: divide by the deviation; ``False`` keeps the centred rewards (Dr. GRPO).

    Returns:
        Advantages of the same shape; with one response per prompt, the rewards themselves (verl's mean 0 and
        standard deviation 1 for a group of one, whose unbiased deviation is NaN).
    """
    if group_size == 1:
        return rewards.clone()
    # NOTE: statistics in float64: a float32 mean of equal graded rewards (eight times 0.7) is not the reward
    # itself, so a group with nothing to prefer got advantages of +0.056 instead of 0. In float64 the sum of up
    # to 2**29 equal float32 values is exact, so a constant group is exactly 0.
    grouped = rewards.reshape(-1, group_size).double()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + epsilon)
    return centred.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other rewards of its group (a group of one keeps its reward, as
    in verl)."""
    if group_size == 1:
        return rewards.clone()
    return group_advantages(rewards, group_size, scale_by_std=False) * group_size / (group_size - 1)


def outcome_advantages(
    scores: torch.Tensor,
    loss_mask: torch.Tensor,
    group_size: int,
    config: AdvantageConfig,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token advantages of ``config.adv_estimator`` from one score per sequence (see the module docstring).

    Args:
        scores: ``(sequences,)`` one score per response, group-major.
        loss_mask: jagged, the response tokens; a sequence without loss tokens takes no part.
        group_size: responses per prompt.
        config: the estimator.
        group: the ranks whose loss tokens the whitening estimators reduce over.

    Raises:
        ConfigError: the estimator needs a critic.
    """
    if config.needs_critic:
        raise ConfigError(
            f"adv_estimator={config.adv_estimator!r} needs a critic's values (drivetrain_roles.advantages.compute_gae); "
            f"without one choose one of {', '.join(OUTCOME_ESTIMATORS)}."
        )
    tokens = FlatTokens.from_jagged(loss_mask)
    sequence_ids = tokens.sequence_ids()
    name = config.adv_estimator
    if name == "reinforce_plus_plus":
        per_token = scores.float()[sequence_ids] * config.gamma ** _later_loss_tokens(tokens)
    else:
        per_token = _sequence_advantages(scores.float(), group_size, config)[sequence_ids]
    advantages = jagged(tokens.select(per_token), tokens.offsets)
    return whiten(advantages, loss_mask, group=group) if name in _WHITENED else advantages


def _sequence_advantages(scores: torch.Tensor, group_size: int, config: AdvantageConfig) -> torch.Tensor:
    name = config.adv_estimator
    if name == "rloo":
        return leave_one_out_advantages(scores, group_size)
    scale = name == "grpo" and config.scale_by_std is not False
    return group_advantages(scores, group_size, config.epsilon, scale_by_std=scale)


def _later_loss_tokens(tokens: FlatTokens) -> torch.Tensor:
    """Per position, how many loss tokens of its sequence come after it (the steps to the scored last one)."""
    inclusive = torch.cumsum(tokens.mask, 0)
    before_sequence = torch.nn.functional.pad(inclusive, (1, 0))[tokens.offsets[:-1]]
    sequence_ids = tokens.sequence_ids()
    per_sequence = tokens.per_sequence_sum(torch.ones_like(tokens.mask))
    return per_sequence[sequence_ids] - (inclusive - before_sequence[sequence_ids])
