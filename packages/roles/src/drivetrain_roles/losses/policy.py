"""The actor's policy loss: a surrogate chosen by ``loss_mode`` (PPO-clip with dual-clip, GSPO, CISPO), an optional
KL penalty and an entropy bonus, aggregated by ``loss_agg_mode``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.outputs import LossContext, LossFn
from tensordict import TensorDict

from .aggregation import FlatTokens, aggregate, check_aggregation_mode, flat_values, masked_fraction
from .kl import canonical_estimator, kl_penalty
from .names import choose
from .surrogates import LOG_RATIO_CLAMP, POLICY_LOSS_MODES, SURROGATES


@dataclass(kw_only=True, frozen=True)
class PolicyLossConfig:
    """Settings of the policy loss.

    Attributes:
        loss_mode: the surrogate (verl's ``actor.policy_loss.loss_mode``): ``vanilla`` (PPO-clip with dual-clip),
            ``gspo`` (one clipped ratio per sequence) or ``cispo`` (clipped ratio as a constant weight); see
            :mod:`.surrogates`.
        clip_ratio_low: the ratio is clipped below at ``1 - clip_ratio_low``; in [0, 1), except for ``cispo``,
            where ``>= 1`` leaves its weight unbounded below.
        clip_ratio_high: the ratio is clipped above at ``1 + clip_ratio_high`` (DAPO's clip-higher when larger).
        clip_ratio_c: dual-clip bound of ``vanilla``: for negative advantages the loss is at most
            ``-A * clip_ratio_c`` (must be > 1); ``None`` disables dual-clip. GSPO and CISPO have none.
        loss_agg_mode: aggregation over tokens (see :func:`~drivetrain_roles.losses.aggregation.aggregate`).
        loss_scale_factor: the constant length of ``loss_agg_mode=seq-mean-token-sum-norm`` (read by no other).
        entropy_coeff: weight of the entropy bonus (subtracted from the loss).
        kl_loss_coef: weight of the KL penalty against ``ref_log_prob``; 0 disables it.
        kl_estimator: ``k1``, ``k2``, ``k3`` (``low_var_kl``) or ``abs``.
        rollout_is_cap: the truncated importance-sampling correction (Yao et al., "Your efficient RL framework
            secretly brings you off-policy RL training", 2025): each token's surrogate is weighted by
            ``min(exp(old_log_probs - rollout_log_probs), rollout_is_cap)`` (a constant, no gradient), so tokens
            the rollout sampled from other weights (an older version, another engine's kernels) are reweighted
            to the policy the update starts from; ``None`` disables it. Needs the batch field
            ``rollout_log_probs``.
    """

    loss_mode: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    rollout_is_cap: float | None = None

    def __post_init__(self) -> None:
        choose("loss_mode", self.loss_mode, POLICY_LOSS_MODES)
        if not (self.clip_ratio_low >= 0 and self.clip_ratio_high >= 0):
            raise ConfigError(
                f"clip_ratio_low and clip_ratio_high must be >= 0, got {self.clip_ratio_low}, {self.clip_ratio_high}."
            )
        if self.clip_ratio_low >= 1 and self.loss_mode != "cispo":
            # NOTE: CISPO's weight has no lower bound in its paper; verl's CISPO example sets clip_ratio_low=10.
            raise ConfigError(
                f"clip_ratio_low={self.clip_ratio_low} with loss_mode={self.loss_mode!r}: the ratio's lower bound "
                f"1 - clip_ratio_low would be <= 0, so the clip could never act; choose clip_ratio_low in [0, 1) "
                "(0.2 is PPO's and DAPO's). Only loss_mode=cispo takes >= 1, for no lower bound."
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ConfigError(
                f"clip_ratio_c={self.clip_ratio_c}: the dual-clip bound must be > 1 (the loss of a negative advantage "
                "is capped at clip_ratio_c x |A|, above the clipped ratio's 1 + clip_ratio_high; verl's default is "
                "3.0), or null to disable dual-clip."
            )
        if self.kl_loss_coef < 0:
            raise ConfigError(f"kl_loss_coef must be >= 0, got {self.kl_loss_coef}.")
        check_aggregation_mode(self.loss_agg_mode, self.loss_scale_factor)
        if self.loss_mode == "gspo" and self.loss_agg_mode != "seq-mean-token-mean":
            raise ConfigError(
                f"loss_mode='gspo' with loss_agg_mode={self.loss_agg_mode!r}: GSPO's objective is a mean over "
                "sequences of one ratio each, so it takes loss_agg_mode='seq-mean-token-mean'; set that (verl uses "
                "it for GSPO whatever loss_agg_mode says)."
            )
        canonical_estimator(self.kl_estimator)
        if self.rollout_is_cap is not None and not self.rollout_is_cap >= 1:
            raise ConfigError(
                f"rollout_is_cap={self.rollout_is_cap}: the importance weight's cap must be >= 1 (a cap below 1 "
                "down-weights even tokens sampled from the policy itself; 2.0 is the usual value), or null to "
                "disable the correction."
            )

    @property
    def uses_kl(self) -> bool:
        return self.kl_loss_coef > 0

    @property
    def uses_rollout_is(self) -> bool:
        """Whether the loss weights tokens by the truncated importance ratio to the rollout's policy."""
        return self.rollout_is_cap is not None

    @property
    def uses_entropy(self) -> bool:
        """Whether the loss has an entropy bonus, so that the model output must carry ``entropy``."""
        return self.entropy_coeff != 0


def policy_loss_fn(config: PolicyLossConfig) -> LossFn:
    """A loss function for the actor: batch fields ``old_log_probs``, ``advantages`` (+ ``ref_log_prob``); the
    surrogate is ``config.loss_mode``'s.

    With an entropy bonus the model output must carry ``entropy`` (the actor then sets
    ``compute_entropy=True``). Metrics are contributions that sum to mini-batch values: ``pg_loss``,
    ``pg_clipfrac``, ``pg_clipfrac_lower``, ``approx_kl`` (mean ``log pi_old - log pi``), with an entropy bonus
    ``entropy`` and with a KL penalty ``kl_loss``.
    """

    def loss_fn(model_output: TensorDict, micro_batch: TensorDict, context: LossContext):
        tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
        log_probs = flat_values(model_output["log_probs"])

        def aggregate_as_configured(values: torch.Tensor) -> torch.Tensor:
            return aggregate(
                values, tokens, context, config.loss_agg_mode, loss_scale_factor=config.loss_scale_factor
            )

        terms = SURROGATES[config.loss_mode](
            log_probs,
            tokens.select(flat_values(micro_batch["old_log_probs"])),
            tokens.select(flat_values(micro_batch["advantages"])),
            config,
            tokens,
        )
        per_token = terms.loss
        correction: dict[str, torch.Tensor] = {}
        if config.rollout_is_cap is not None:
            weight, capped = truncated_is_weight(
                tokens.select(flat_values(micro_batch["old_log_probs"])),
                tokens.select(flat_values(micro_batch["rollout_log_probs"])),
                config.rollout_is_cap,
            )
            per_token = per_token * weight
            correction = {
                "rollout_is_weight": aggregate(weight, tokens, context, "token-mean"),
                "rollout_is_capped": masked_fraction(capped, tokens, context),
            }
        loss = pg_loss = aggregate_as_configured(per_token)
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": masked_fraction(terms.clipped, tokens, context),
            "pg_clipfrac_lower": masked_fraction(terms.dual_clipped, tokens, context),
            "approx_kl": aggregate(-terms.log_ratio.detach(), tokens, context, "token-mean"),
            **correction,
        }
        if config.uses_entropy:
            entropy = aggregate_as_configured(flat_values(model_output["entropy"]))
            loss = loss - config.entropy_coeff * entropy
            metrics["entropy"] = entropy.detach()
        if config.uses_kl:
            per_token_kl = kl_penalty(
                tokens.select(log_probs),
                tokens.select(flat_values(micro_batch["ref_log_prob"])),
                config.kl_estimator,
            )
            kl_loss = aggregate_as_configured(per_token_kl)
            loss = loss + config.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        return loss, metrics

    return loss_fn


def truncated_is_weight(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``min(pi_old / pi_rollout, cap)`` (detached) and where the cap acted.

    NOTE: the log-ratio is clamped before ``exp`` as the surrogates clamp theirs: a token the old weights
    find far likelier than the rollout did must not overflow to inf (the cap then holds it anyway).
    """
    log_ratio = (old_log_probs - rollout_log_probs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    return ratio.clamp(max=cap), ratio > cap
