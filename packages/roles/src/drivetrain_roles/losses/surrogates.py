"""The per-token policy-gradient surrogates ``loss_mode`` selects (verl's names): PPO-clip, GSPO and CISPO.

Each takes the flat per-token log-probs of the current policy, the rollout policy's (``old``) and the
advantages, and returns :class:`PolicyTerms`; :func:`~.policy.policy_loss_fn` aggregates them.

- ``vanilla`` (PPO-clip, Schulman et al. 2017, with the dual clip of Ye et al. 2020):
  ``max(-A r, -A clip(r, 1 - low, 1 + high))`` per token, bounded by ``-A c`` where ``A < 0``.
- ``gspo`` (Zheng et al. 2025): one ratio per sequence, ``s = exp(mean_t log r_t)``, clipped like PPO's; per token
  it is written ``sg(s) * pi / sg(pi)``, whose value is ``s`` and whose gradient is ``s * grad log pi``, so a
  per-sequence mean over tokens gives GSPO's gradient ``s * mean_t grad log pi_t``.
- ``cispo`` (MiniMax-M1, 2025): the clipped ratio is a constant weight, ``-sg(clip(r, 1 - low, 1 + high)) A log pi``,
  so every token keeps a gradient (PPO's clip zeroes the clipped ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .aggregation import FlatTokens
from .names import POLICY_LOSS_MODES as POLICY_LOSS_MODES  # importable from here since 0.1.0

if TYPE_CHECKING:
    from .config import PolicyLossConfig

LOG_RATIO_CLAMP = 20.0
"""The log-ratio is clamped before ``exp`` so that a stale token cannot overflow the ratio to inf."""


@dataclass(frozen=True)
class PolicyTerms:
    """Per-token pieces of a policy surrogate (flat tensors).

    Attributes:
        loss: per-token policy-gradient loss.
        clipped: where clipping changed the token's term (PPO, GSPO: the clipped surrogate was active; CISPO:
            the ratio lay outside the clip range).
        dual_clipped: where dual-clip bounded the loss (PPO-clip, negative advantages only).
        log_ratio: ``log pi - log pi_old`` per token (for the approximate KL).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    log_ratio: torch.Tensor


def _token_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clip(ratio: torch.Tensor, config: PolicyLossConfig) -> torch.Tensor:
    return ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)


def clipped_policy_terms(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    tokens: FlatTokens | None = None,
) -> PolicyTerms:
    """PPO's clipped surrogate per token: ``max(-A r, -A clip(r))``, with dual-clip for ``A < 0``."""
    del tokens  # per token: the layout does not matter
    log_ratio = _token_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * _clip(ratio, config)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if config.clip_ratio_c is not None:
        bound = -advantages * config.clip_ratio_c
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return PolicyTerms(loss=loss, clipped=clipped > unclipped, dual_clipped=dual_clipped, log_ratio=log_ratio)


def gspo_terms(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    tokens: FlatTokens | None = None,
) -> PolicyTerms:
    """GSPO's clipped sequence-level surrogate, written per token (see the module docstring); no dual clip."""
    if tokens is None:
        raise ValueError("gspo_terms needs the tokens' sequence layout (the ratio is one per sequence).")
    token_log_ratio = _token_log_ratio(log_probs, old_log_probs)
    counts = tokens.per_sequence_sum(torch.ones_like(token_log_ratio)).clamp(min=1.0)
    sequence_log_ratio = (tokens.per_sequence_sum(token_log_ratio.detach()) / counts).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    log_ratio = (
        log_probs - log_probs.detach() + sequence_log_ratio[tokens.sequence_ids().to(log_probs.device)]
    )
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * _clip(ratio, config)
    return PolicyTerms(
        loss=torch.maximum(unclipped, clipped),
        clipped=clipped > unclipped,
        dual_clipped=torch.zeros_like(unclipped, dtype=torch.bool),
        log_ratio=token_log_ratio,
    )


def cispo_terms(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    tokens: FlatTokens | None = None,
) -> PolicyTerms:
    """CISPO: ``-sg(clip(r)) * A * log pi`` per token; no dual clip."""
    del tokens
    log_ratio = _token_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    weight = _clip(ratio, config).detach()
    return PolicyTerms(
        loss=-weight * advantages * log_probs,
        clipped=weight != ratio.detach(),
        dual_clipped=torch.zeros_like(ratio, dtype=torch.bool),
        log_ratio=log_ratio,
    )


Surrogate = Callable[..., PolicyTerms]
SURROGATES: dict[str, Surrogate] = dict(
    zip(POLICY_LOSS_MODES, (clipped_policy_terms, gspo_terms, cispo_terms), strict=True)
)
"""``loss_mode`` -> its per-token surrogate (verl's ``actor.policy_loss.loss_mode`` names)."""
