"""Estimators of KL(pi || pi_ref) per token from the two log-probabilities of the sampled token.

With ``delta = log pi_ref - log pi`` (sampled from pi): ``k1 = -delta`` is unbiased but high-variance and can
be negative; ``k2 = delta**2 / 2`` is low-variance but biased; ``k3 = exp(delta) - 1 - delta`` (the "low
variance" estimator) is unbiased and always >= 0; ``abs = |delta|`` (verl's ``abs``) is >= 0 but biased. See
J. Schulman, "Approximating KL Divergence" (2020). Aliases are verl's names: ``kl`` (k1), ``mse`` (k2),
``low_var_kl`` (k3).
"""

from __future__ import annotations

import torch

from .names import KL_ESTIMATORS as KL_ESTIMATORS  # importable from here since 0.1.0
from .names import canonical_estimator

K3_CLAMP = 10.0
"""k3 is clamped to [-10, 10] per token: one token whose ratio explodes must not dominate the batch."""
DELTA_CLAMP = 20.0
"""``delta`` is clamped to [-20, 20] before k3's ``exp`` (as verl does): beyond it k3 is clamped anyway, and an
unclamped ``exp`` overflows to inf, whose gradient (``0 * inf``) is NaN even where the loss selects it out."""


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the current policy and the reference.

    Args:
        log_probs: log pi of the sampled tokens (any shape).
        ref_log_probs: log pi_ref of the same tokens.
        estimator: ``k1``, ``k2``, ``k3`` or ``abs`` (or an alias).

    Returns:
        A tensor of the same shape as ``log_probs``.
    """
    estimator = canonical_estimator(estimator)
    delta = ref_log_probs - log_probs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "abs":
        return delta.abs()
    delta = delta.clamp(min=-DELTA_CLAMP, max=DELTA_CLAMP)
    return (torch.exp(delta) - 1.0 - delta).clamp(min=-K3_CLAMP, max=K3_CLAMP)
