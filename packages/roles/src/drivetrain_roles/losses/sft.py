"""Supervised fine-tuning loss: negative log-likelihood of the loss-mask (response) tokens."""

from __future__ import annotations

import torch
from drivetrain_engine_core.job import LossContext, LossFn
from tensordict import TensorDict

from .aggregation import FlatTokens, aggregate, check_aggregation_mode, flat_values


def sft_nll(
    log_probs: torch.Tensor, tokens: FlatTokens, context: LossContext, mode: str = "token-mean"
) -> torch.Tensor:
    """Negative log-likelihood of flat per-token ``log_probs`` aggregated by ``mode`` over the mini-batch.

    Args:
        log_probs: flat ``(total_tokens,)`` log-probabilities of each token given the tokens before it.
        tokens: mask and sequence layout of the micro-batch.
        context: global counts that normalise the loss.
        mode: an aggregation mode of :func:`~drivetrain_roles.losses.aggregation.aggregate`.

    Returns:
        This micro-batch's contribution to the mini-batch loss.
    """
    return aggregate(-log_probs, tokens, context, mode)


def sft_loss_fn(mode: str = "token-mean") -> LossFn:
    """A loss function for ``Engine.train_batch`` that trains on the loss-mask tokens.

    Args:
        mode: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.

    Raises:
        ValueError: ``mode`` is unknown.
    """
    check_aggregation_mode(mode)

    def loss_fn(model_output: TensorDict, micro_batch: TensorDict, context: LossContext):
        tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
        loss = sft_nll(flat_values(model_output["log_probs"]), tokens, context, mode)
        return loss, {}

    return loss_fn
