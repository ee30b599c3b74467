"""Losses over jagged per-token tensors, normalised by global mini-batch counts (see ``aggregation``)."""

from .aggregation import (
    AGGREGATION_MODES,
    CONSTANT_LENGTH_MODE,
    POLICY_AGGREGATION_MODES,
    FlatTokens,
    aggregate,
    flat_values,
)
from .kl import KL_ESTIMATORS, kl_penalty
from .policy import PolicyLossConfig, policy_loss_fn
from .sft import sft_loss_fn, sft_nll
from .surrogates import POLICY_LOSS_MODES, PolicyTerms, cispo_terms, clipped_policy_terms, gspo_terms
from .value import ValueLossConfig, clipped_value_terms, value_loss_fn

__all__ = [
    "AGGREGATION_MODES",
    "CONSTANT_LENGTH_MODE",
    "KL_ESTIMATORS",
    "POLICY_AGGREGATION_MODES",
    "POLICY_LOSS_MODES",
    "FlatTokens",
    "PolicyLossConfig",
    "PolicyTerms",
    "ValueLossConfig",
    "aggregate",
    "cispo_terms",
    "clipped_policy_terms",
    "clipped_value_terms",
    "flat_values",
    "gspo_terms",
    "kl_penalty",
    "policy_loss_fn",
    "sft_loss_fn",
    "sft_nll",
    "value_loss_fn",
]
