"""The actor's policy loss: a surrogate chosen by ``loss_mode`` (PPO-clip with dual-clip, GSPO, CISPO), an optional
KL penalty and an entropy bonus, aggregated by ``loss_agg_mode``."""

from __future__ import annotations

import torch
from drivetrain_engine_core.job import LossContext, LossFn
from tensordict import TensorDict

from .aggregation import FlatTokens, aggregate, flat_values, masked_fraction
from .config import PolicyLossConfig as PolicyLossConfig  # importable from here since 0.1.0
from .kl import kl_penalty
from .surrogates import LOG_RATIO_CLAMP, SURROGATES


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
