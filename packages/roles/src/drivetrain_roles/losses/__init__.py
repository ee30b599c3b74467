"""Losses over jagged per-token tensors, normalised by global mini-batch counts (see ``aggregation``)."""

from .aggregation import AGGREGATION_MODES, FlatTokens, aggregate, flat_values
from .kl import KL_ESTIMATORS, kl_penalty
from .policy import PolicyLossConfig, PolicyTerms, clipped_policy_terms, policy_loss_fn
from .sft import sft_loss_fn, sft_nll
from .value import ValueLossConfig, clipped_value_terms, value_loss_fn

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "FlatTokens",
    "PolicyLossConfig",
    "PolicyTerms",
    "ValueLossConfig",
    "aggregate",
    "clipped_policy_terms",
    "clipped_value_terms",
    "flat_values",
    "kl_penalty",
    "policy_loss_fn",
    "sft_loss_fn",
    "sft_nll",
    "value_loss_fn",
]
