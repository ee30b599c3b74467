"""Clipped value loss of PPO's critic."""

from __future__ import annotations

import torch
from drivetrain_engine_core.job import LossContext, LossFn
from tensordict import TensorDict

from .aggregation import FlatTokens, aggregate, flat_values, masked_fraction
from .config import ValueLossConfig as ValueLossConfig  # importable from here since 0.1.0


def clipped_value_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)`` and where the clipped term is larger.

    Returns:
        ``(per_token_loss, clipped)``; ``clipped`` is a bool tensor.
    """
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def value_loss_fn(config: ValueLossConfig) -> LossFn:
    """A loss function for a value-model engine; the batch carries rollout ``values`` and ``returns``.

    Metrics (contributions that sum to the mini-batch value): ``vf_loss``, ``vf_clipfrac``.
    """

    def loss_fn(model_output: TensorDict, micro_batch: TensorDict, context: LossContext):
        tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
        per_token, clipped = clipped_value_terms(
            flat_values(model_output["values"]),
            tokens.select(flat_values(micro_batch["values"])),
            tokens.select(flat_values(micro_batch["returns"])),
            config.cliprange_value,
        )
        loss = aggregate(per_token, tokens, context, config.loss_agg_mode)
        metrics = {"vf_loss": loss.detach(), "vf_clipfrac": masked_fraction(clipped, tokens, context)}
        return loss, metrics

    return loss_fn
