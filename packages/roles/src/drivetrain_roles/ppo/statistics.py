"""What a PPO step reports about its returns, values and advantages, over every data-parallel rank's tokens."""

from __future__ import annotations

import math

import torch
from drivetrain_engine_core.kit import distributed
from torch.distributed import ProcessGroup

from ..losses.aggregation import FlatTokens, flat_values


def value_statistics(
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    group: ProcessGroup | None = None,
) -> dict[str, float]:
    """Token means over the response tokens of every rank of ``group`` (one all-reduce).

    Returns:
        ``critic/advantages_mean`` and ``critic/advantages_std`` (GAE's, before whitening),
        ``critic/returns_mean``, ``critic/values_mean`` and ``critic/vf_explained_var``:
        ``1 - Var(returns - values) / Var(returns)`` (1: the critic predicts the returns, 0: no better than
        their mean; verl's ``critic/vf_explained_var``).
    """
    tokens = FlatTokens.from_jagged(loss_mask)
    # Sums in float64: the one-pass variances cancel in float32 when the values sit far from 0.
    a, r, v = (tokens.select(flat_values(t).double()) for t in (advantages, returns, values))
    residual = r - v
    count, *sums = distributed.all_reduce_sums(
        [
            float(tokens.mask.sum()),
            *(float(x.sum()) for x in (a, r, v, residual)),
            *(float(x.square().sum()) for x in (a, r, residual)),
        ],
        group,
    )
    count = max(count, 1.0)
    a_mean, r_mean, v_mean, residual_mean = (s / count for s in sums[:4])
    a_var, r_var, residual_var = (
        max(square / count - mean * mean, 0.0)
        for square, mean in zip(sums[4:], (a_mean, r_mean, residual_mean), strict=True)
    )
    return {
        "critic/advantages_mean": a_mean,
        "critic/advantages_std": math.sqrt(a_var),
        "critic/returns_mean": r_mean,
        "critic/values_mean": v_mean,
        "critic/vf_explained_var": 1.0 - residual_var / r_var if r_var > 0 else 0.0,
    }
