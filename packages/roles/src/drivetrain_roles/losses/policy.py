"""PPO's clipped policy loss with dual-clip, an optional KL penalty and an entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.outputs import LossContext, LossFn
from tensordict import TensorDict

from .aggregation import FlatTokens, aggregate, check_aggregation_mode, flat_values, masked_fraction
from .kl import canonical_estimator, kl_penalty

LOG_RATIO_CLAMP = 20.0
"""The log-ratio is clamped before ``exp`` so that a stale token cannot overflow the ratio to inf."""


@dataclass(kw_only=True, frozen=True)
class PolicyLossConfig:
    """Settings of the PPO policy loss.

    Attributes:
        clip_ratio_low: the ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: the ratio is clipped above at ``1 + clip_ratio_high`` (DAPO's clip-higher when larger).
        clip_ratio_c: dual-clip bound: for negative advantages the loss is at most ``-A * clip_ratio_c``
            (must be > 1); ``None`` disables dual-clip.
        loss_agg_mode: aggregation over tokens (see :func:`~drivetrain_roles.losses.aggregation.aggregate`).
        entropy_coeff: weight of the entropy bonus (subtracted from the loss).
        kl_loss_coef: weight of the KL penalty against ``ref_log_prob``; 0 disables it.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (``low_var_kl``).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(
                f"clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0, got {self.clip_ratio_low}, "
                f"{self.clip_ratio_high}."
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c (dual-clip) must be > 1 or None, got {self.clip_ratio_c}.")
        if self.kl_loss_coef < 0:
            raise ValueError(f"kl_loss_coef must be >= 0, got {self.kl_loss_coef}.")
        check_aggregation_mode(self.loss_agg_mode)
        canonical_estimator(self.kl_estimator)

    @property
    def uses_kl(self) -> bool:
        return self.kl_loss_coef > 0

    @property
    def uses_entropy(self) -> bool:
        """Whether the loss has an entropy bonus, so that the model output must carry ``entropy``."""
        return self.entropy_coeff != 0


@dataclass(frozen=True)
class PolicyTerms:
    """Per-token pieces of the clipped objective (flat tensors).

    Attributes:
        loss: per-token policy-gradient loss after clipping and dual-clip.
        clipped: where the clipped surrogate was the active term.
        dual_clipped: where dual-clip bounded the loss (negative advantages only).
        log_ratio: ``log pi - log pi_old`` (for the approximate KL).
    """

    loss: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor
    log_ratio: torch.Tensor


def clipped_policy_terms(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig
) -> PolicyTerms:
    """PPO's clipped surrogate per token: ``max(-A r, -A clip(r))``, with dual-clip for ``A < 0``."""
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if config.clip_ratio_c is not None:
        bound = -advantages * config.clip_ratio_c
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    return PolicyTerms(loss=loss, clipped=clipped > unclipped, dual_clipped=dual_clipped, log_ratio=log_ratio)


def policy_loss_fn(config: PolicyLossConfig) -> LossFn:
    """A loss function for the actor: batch fields ``old_log_probs``, ``advantages`` (+ ``ref_log_prob``).

    With an entropy bonus the model output must carry ``entropy`` (the actor then sets
    ``compute_entropy=True``). Metrics are contributions that sum to mini-batch values: ``pg_loss``,
    ``pg_clipfrac``, ``pg_clipfrac_lower``, ``approx_kl`` (mean ``log pi_old - log pi``), with an entropy bonus
    ``entropy`` and with a KL penalty ``kl_loss``.
    """

    def loss_fn(model_output: TensorDict, micro_batch: TensorDict, context: LossContext):
        tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
        log_probs = flat_values(model_output["log_probs"])
        terms = clipped_policy_terms(
            log_probs,
            tokens.select(flat_values(micro_batch["old_log_probs"])),
            tokens.select(flat_values(micro_batch["advantages"])),
            config,
        )
        loss = pg_loss = aggregate(terms.loss, tokens, context, config.loss_agg_mode)
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": masked_fraction(terms.clipped, tokens, context),
            "pg_clipfrac_lower": masked_fraction(terms.dual_clipped, tokens, context),
            "approx_kl": aggregate(-terms.log_ratio.detach(), tokens, context, "token-mean"),
        }
        if config.uses_entropy:
            entropy = aggregate(flat_values(model_output["entropy"]), tokens, context, config.loss_agg_mode)
            loss = loss - config.entropy_coeff * entropy
            metrics["entropy"] = entropy.detach()
        if config.uses_kl:
            per_token_kl = kl_penalty(
                tokens.select(log_probs),
                tokens.select(flat_values(micro_batch["ref_log_prob"])),
                config.kl_estimator,
            )
            kl_loss = aggregate(per_token_kl, tokens, context, config.loss_agg_mode)
            loss = loss + config.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        return loss, metrics

    return loss_fn
