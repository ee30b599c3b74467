"""Losses over jagged per-token tensors, normalised by global mini-batch counts (see ``aggregation``).

Importing the package is cheap: the loss settings and the names they accept (:mod:`.config`, :mod:`.names`)
load eagerly, the loss functions (which need torch) on first attribute access, so that building a command's
config (``--help-config``, ``--print-config``) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from drivetrain_engine_core.kit import lazy_getattr

from .config import PolicyLossConfig, ValueLossConfig
from .names import (
    AGGREGATION_MODES,
    CONSTANT_LENGTH_MODE,
    KL_ESTIMATORS,
    POLICY_AGGREGATION_MODES,
    POLICY_LOSS_MODES,
)

if TYPE_CHECKING:
    from .aggregation import FlatTokens, aggregate, flat_values
    from .kl import kl_penalty
    from .policy import policy_loss_fn
    from .sft import sft_loss_fn, sft_nll
    from .surrogates import PolicyTerms, cispo_terms, clipped_policy_terms, gspo_terms
    from .value import clipped_value_terms, value_loss_fn

_LAZY = {
    "FlatTokens": "aggregation",
    "aggregate": "aggregation",
    "flat_values": "aggregation",
    "kl_penalty": "kl",
    "policy_loss_fn": "policy",
    "sft_loss_fn": "sft",
    "sft_nll": "sft",
    "PolicyTerms": "surrogates",
    "cispo_terms": "surrogates",
    "clipped_policy_terms": "surrogates",
    "gspo_terms": "surrogates",
    "clipped_value_terms": "value",
    "value_loss_fn": "value",
}

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


__getattr__ = lazy_getattr(__name__, _LAZY)
