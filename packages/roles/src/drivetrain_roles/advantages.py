"""PPO's advantages on no-padding batches: token rewards, a KL penalty in the reward, GAE, whitening, KL control.

The pieces a PPO loop with a critic needs between the rollout and :meth:`Actor.update_policy` /
:meth:`Critic.update_critic`, on jagged per-token tensors aligned as the roles' outputs are (position ``i``
holds token ``i``: its log-prob, its reward, and ``values[i]``, the critic's value of the state that emits it;
docs/architecture.md §7.1). Only the loss-mask (response) tokens of a sequence take part, in order: they are
the steps of the episode, and every other position is 0 in the results.

A typical step (verl's and OpenRLHF's PPO)::

    rewards = token_rewards(scores, batch["loss_mask"])              # the sequence's score on its last token
    rewards, kl = apply_kl_penalty(rewards, old_log_probs, ref_log_probs, batch["loss_mask"], coef=kl_ctl.value)
    advantages, returns = compute_gae(rewards, values, batch["loss_mask"], gamma=1.0, lam=0.95)
    batch["advantages"] = whiten(advantages, batch["loss_mask"])     # over every data-parallel rank's tokens
    batch["returns"] = returns
    kl_ctl.update(kl, n_steps=global_batch_size)

Whitening and the reported KL reduce over ``group``: pass the data-parallel group
(``engine.data_parallel_group``) so every rank whitens with the global batch's statistics; the default, every
rank, counts tensor- or pipeline-parallel replicas' tokens once per replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import jagged
from drivetrain_engine_core.kit import distributed
from torch.distributed import ProcessGroup

from .losses.aggregation import FlatTokens, flat_values
from .losses.kl import kl_penalty


def token_rewards(scores: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Jagged per-token rewards holding each sequence's ``scores`` entry on its last loss token, 0 elsewhere.

    Raises:
        BatchError: ``scores`` does not hold one number per sequence, or a sequence has no loss token.
    """
    tokens = FlatTokens.from_jagged(loss_mask)
    count = tokens.num_sequences
    if scores.shape != (count,):
        raise BatchError(
            f"token_rewards: scores has shape {tuple(scores.shape)}, want ({count},): one per sequence."
        )
    flat = torch.zeros_like(tokens.mask)
    flat[_last_loss_token(tokens)] = scores.to(device=flat.device, dtype=torch.float32)
    return jagged(flat, tokens.offsets)


def apply_kl_penalty(
    rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, float]:
    """``rewards - coef * KL`` on every loss token (verl's ``apply_kl_penalty``, k1 by default as in the PPO
    of Ziegler et al.), and the token-mean KL over the loss tokens of every rank of ``group``, which an
    :class:`AdaptiveKLController` follows.
    """
    tokens = FlatTokens.from_jagged(loss_mask)
    kl = tokens.select(kl_penalty(_float_values(log_probs), _float_values(ref_log_probs), estimator))
    total, count = distributed.all_reduce_sums([float(kl.sum()), int(tokens.mask.sum())], group)
    penalised = _float_values(rewards) - coef * kl
    return jagged(penalised, tokens.offsets), total / max(count, 1)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each sequence's loss tokens (Schulman et al. 2016).

    On the loss tokens ``t = 0 .. T-1`` of a sequence: ``delta_t = r_t + gamma * V_{t+1} - V_t`` with
    ``V_T = 0`` (the episode ends with the response), ``A_t = delta_t + gamma * lam * A_{t+1}``, and the critic's
    target ``returns_t = A_t + V_t``.

    Returns:
        ``(advantages, returns)``, jagged like ``loss_mask``, 0 off the loss tokens (float32).
    """
    tokens = FlatTokens.from_jagged(loss_mask)
    mask, offsets = tokens.mask.bool(), tokens.offsets
    rows, columns, width = _loss_token_grid(tokens)
    shape = (tokens.num_sequences, width)
    dense_rewards = _to_grid(_float_values(rewards), mask, rows, columns, shape)
    dense_values = _to_grid(_float_values(values), mask, rows, columns, shape)
    valid = _to_grid(tokens.mask, mask, rows, columns, shape)
    advantages = torch.zeros_like(dense_rewards)
    following_advantage = torch.zeros(tokens.num_sequences, dtype=torch.float32, device=mask.device)
    following_value = torch.zeros_like(following_advantage)
    for t in reversed(range(width)):
        delta = dense_rewards[:, t] + gamma * following_value - dense_values[:, t]
        advantage = (delta + gamma * lam * following_advantage) * valid[:, t]
        advantages[:, t] = advantage
        following_advantage, following_value = advantage, dense_values[:, t] * valid[:, t]
    returns = advantages + dense_values
    return _from_grid(advantages, mask, offsets, rows, columns), _from_grid(
        returns, mask, offsets, rows, columns
    )


def whiten(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over the loss tokens of every rank of ``group`` (verl's
    ``masked_whiten``, unbiased variance); ``shift_mean=False`` adds the mean back. 0 off the loss tokens.
    """
    tokens = FlatTokens.from_jagged(loss_mask)
    flat = _float_values(values)
    # Sums in float64: the one-pass variance (sum of squares minus count x mean^2) cancels in float32 when the
    # values sit far from 0 (returns, shifted rewards).
    selected = tokens.select(flat.double())
    total, squares, count = distributed.all_reduce_sums(
        [float(selected.sum()), float(selected.square().sum()), int(tokens.mask.sum())], group
    )
    if count < 2:
        raise BatchError(f"whiten: {int(count)} loss tokens over the group; whitening needs at least 2.")
    mean = total / count
    variance = (squares - count * mean * mean) / (count - 1)
    whitened = (flat - mean) / math.sqrt(max(variance, 0.0) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return jagged(tokens.select(whitened), tokens.offsets)


@dataclass
class FixedKLController:
    """A KL coefficient that stays at ``value``."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


@dataclass
class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019): raised when the measured KL is above ``target``, lowered when
    below, by at most 20% of ``n_steps / horizon`` per update.

    Attributes:
        value: the current coefficient (start: ``init_kl_coef``).
        target: the KL the coefficient steers towards.
        horizon: samples over which an error of 20% is corrected.
    """

    init_kl_coef: float
    target: float
    horizon: int
    value: float = field(init=False)

    def __post_init__(self) -> None:
        if not (self.init_kl_coef >= 0 and self.target > 0 and self.horizon > 0):
            raise ValueError(
                f"AdaptiveKLController needs init_kl_coef >= 0, target > 0 and horizon > 0, got {self.init_kl_coef}, "
                f"{self.target}, {self.horizon}."
            )
        self.value = self.init_kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt to the KL measured over the last ``n_steps`` samples."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def _float_values(tensor: torch.Tensor) -> torch.Tensor:
    return flat_values(tensor).float()


def _last_loss_token(tokens: FlatTokens) -> torch.Tensor:
    """Flat index of each sequence's last loss token."""
    mask = tokens.mask.bool()
    positions = torch.arange(len(mask), device=mask.device)
    last = torch.full((tokens.num_sequences,), -1, dtype=torch.int64, device=mask.device)
    last = last.scatter_reduce(0, tokens.sequence_ids()[mask], positions[mask], reduce="amax")
    if bool((last < 0).any()):
        raise BatchError(f"sequences {(last < 0).nonzero().flatten().tolist()} have no loss token to score.")
    return last


def _loss_token_grid(tokens: FlatTokens) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row (sequence) and column (step among its loss tokens) of every loss token, and the widest row."""
    mask, offsets, sequence = tokens.mask.bool(), tokens.offsets, tokens.sequence_ids()
    rows = sequence[mask]
    before = torch.cumsum(mask.long(), 0) - mask.long()  # loss tokens before each position, over the batch
    starts = torch.cumsum(torch.nn.functional.pad(mask.long(), (1, 0)), 0)[offsets[:-1]]
    columns = (before - starts[sequence])[mask]
    width = int(columns.max()) + 1 if len(columns) else 0
    return rows, columns, width


def _to_grid(
    flat: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """The loss tokens of ``flat`` as a ``(sequences, widest)`` grid, each sequence's steps left-aligned."""
    grid = torch.zeros(shape, dtype=torch.float32, device=flat.device)
    grid[rows, columns] = flat[mask].float()
    return grid


def _from_grid(
    grid: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    flat = torch.zeros(len(mask), dtype=torch.float32, device=grid.device)
    flat[mask] = grid[rows, columns]
    return jagged(flat, offsets)
