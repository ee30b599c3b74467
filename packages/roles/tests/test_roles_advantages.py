"""PPO's advantage helpers against the formulas written out per sequence in plain Python."""

from __future__ import annotations

import math

import pytest
import torch
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import jagged
from drivetrain_roles.advantages import (
    AdaptiveKLController,
    apply_kl_penalty,
    compute_gae,
    token_rewards,
    whiten,
)

# Three sequences: prompt tokens (mask 0) then response tokens (mask 1); the third has a masked token inside its
# response (a tool's output in a multi-turn rollout), which is not a step of the episode.
MASKS = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 1, 0, 1, 1]]
OFFSETS = torch.tensor([0, 5, 8, 14])


def per_token(rows) -> torch.Tensor:
    return jagged(torch.tensor([x for row in rows for x in row], dtype=torch.float32), OFFSETS)


LOSS_MASK = jagged(torch.tensor([x for row in MASKS for x in row], dtype=torch.bool), OFFSETS)
REWARDS = [[9.0, 9.0, 0.1, -0.2, 1.0], [9.0, 0.0, 2.0], [9.0, 9.0, 0.5, 9.0, 0.0, -1.0]]
VALUES = [[7.0, 7.0, 0.3, 0.6, 0.2], [7.0, 1.5, -0.5], [7.0, 7.0, 0.4, 7.0, 0.1, 0.9]]


def gae_by_hand(rewards, values, mask, gamma, lam):
    steps = [i for i, m in enumerate(mask) if m]
    advantages, following_advantage, following_value = {}, 0.0, 0.0
    for i in reversed(steps):
        delta = rewards[i] + gamma * following_value - values[i]
        following_advantage = delta + gamma * lam * following_advantage
        following_value = values[i]
        advantages[i] = following_advantage
    return [advantages.get(i, 0.0) for i in range(len(mask))], [
        advantages[i] + values[i] if i in advantages else 0.0 for i in range(len(mask))
    ]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_equals_the_recursion_over_each_sequences_response_tokens(gamma, lam):
    advantages, returns = compute_gae(per_token(REWARDS), per_token(VALUES), LOSS_MASK, gamma=gamma, lam=lam)
    for k, (rewards, values, mask) in enumerate(zip(REWARDS, VALUES, MASKS, strict=True)):
        expected_advantages, expected_returns = gae_by_hand(rewards, values, mask, gamma, lam)
        assert advantages[k].tolist() == pytest.approx(expected_advantages, abs=1e-6)
        assert returns[k].tolist() == pytest.approx(expected_returns, abs=1e-6)


def test_gamma_and_lambda_one_give_the_return_to_go_minus_the_value():
    advantages, returns = compute_gae(per_token(REWARDS), per_token(VALUES), LOSS_MASK)
    assert returns[0].tolist() == pytest.approx([0.0, 0.0, 0.9, 0.8, 1.0])  # sums of later response rewards
    assert advantages[1].tolist() == pytest.approx([0.0, 2.0 - 1.5, 2.0 + 0.5])


def test_scores_go_on_each_sequences_last_response_token_and_the_kl_penalty_on_every_one():
    rewards = token_rewards(torch.tensor([1.0, -1.0, 0.5]), LOSS_MASK)
    assert [rewards[k].tolist() for k in range(3)] == [[0, 0, 0, 0, 1.0], [0, 0, -1.0], [0, 0, 0, 0, 0, 0.5]]
    log_probs = per_token([[-1.0] * 5, [-2.0] * 3, [-0.5] * 6])
    ref = per_token([[-1.5] * 5, [-1.0] * 3, [-0.5] * 6])
    penalised, kl = apply_kl_penalty(rewards, log_probs, ref, LOSS_MASK, coef=0.1)
    # k1 = log pi - log pi_ref on the 9 response tokens: 0.5 (x3), -1.0 (x2), 0.0 (x3 of the third sequence).
    assert kl == pytest.approx((3 * 0.5 - 2 * 1.0) / 8)
    assert penalised[0].tolist() == pytest.approx([0, 0, -0.05, -0.05, 0.95])
    assert penalised[1].tolist() == pytest.approx([0, 0.1, -0.9])
    with pytest.raises(BatchError, match=r"scores has shape \(2,\), want \(3,\)"):
        token_rewards(torch.tensor([1.0, 2.0]), LOSS_MASK)


def test_whitening_uses_the_unbiased_statistics_of_the_response_tokens_only():
    values = per_token(REWARDS)
    whitened = whiten(values, LOSS_MASK)
    selected = [
        v for row, mask in zip(REWARDS, MASKS, strict=True) for v, m in zip(row, mask, strict=True) if m
    ]
    mean = sum(selected) / len(selected)
    std = math.sqrt(sum((v - mean) ** 2 for v in selected) / (len(selected) - 1) + 1e-8)
    assert whitened[1].tolist() == pytest.approx([0.0, (0.0 - mean) / std, (2.0 - mean) / std], abs=1e-6)
    assert whiten(values, LOSS_MASK, shift_mean=False)[1][2] == pytest.approx(
        (2.0 - mean) / std + mean, abs=1e-6
    )


def test_the_adaptive_kl_coefficient_follows_ziegler_et_al():
    controller = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10_000)
    controller.update(current_kl=9.0, n_steps=256)  # 50% over target: the error is clipped to 20%
    assert controller.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000))
    controller.update(current_kl=5.4, n_steps=256)  # 10% under
    assert controller.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000) * (1 - 0.1 * 256 / 10_000))


def test_whitening_keeps_its_precision_far_from_zero():
    """A one-pass float32 variance cancels: values of mean 100 and deviation 0.01 whitened to a deviation of 0.56."""
    generator = torch.Generator().manual_seed(0)
    flat = 100.0 + 0.01 * torch.randn(200_000, generator=generator)
    offsets = torch.tensor([0, 100_000, 200_000])
    whitened = whiten(jagged(flat, offsets), jagged(torch.ones(200_000, dtype=torch.bool), offsets))
    assert float(whitened.values().std()) == pytest.approx(1.0, abs=1e-3)
