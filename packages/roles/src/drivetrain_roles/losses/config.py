"""The losses' settings: what each loss is configured with, checked when built.

Imports no torch: the commands' config sections are built from these (``--help-config`` and ``--print-config``
among them); the loss functions that read them live beside the math (:mod:`.policy`, :mod:`.value`,
:mod:`.preference`).
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError

from .names import POLICY_LOSS_MODES, canonical_estimator, check_aggregation_mode, choose

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")
"""The DPO losses ``dpo.loss_type`` selects."""


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


@dataclass(kw_only=True, frozen=True)
class ValueLossConfig:
    """Settings of the clipped value loss.

    Attributes:
        cliprange_value: new values may move at most this far from the rollout's values before the clipped
            term takes over.
        loss_agg_mode: aggregation over tokens (see :func:`~drivetrain_roles.losses.aggregation.aggregate`).
    """

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}.")
        check_aggregation_mode(self.loss_agg_mode)


@dataclass(kw_only=True, frozen=True)
class DPOLossConfig:
    """Settings of the DPO loss.

    Attributes:
        beta: strength of the implicit KL constraint (the reward scale ``beta * log-ratio``).
        loss_type: ``sigmoid`` (DPO) or ``ipo`` (on per-token mean log-probs, as TRL).
        reference_free: use log pi itself as the log-ratio (a uniform reference, ``ref_logp = 0``).
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    reference_free: bool = False

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta must be > 0, got {self.beta}.")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(
                f"dpo.loss_type={self.loss_type!r} is not supported; choose one of {list(DPO_LOSS_TYPES)}."
            )


@dataclass(kw_only=True, frozen=True)
class RewardLossConfig:
    """Settings of the reward-model loss.

    Attributes:
        center_rewards_coefficient: weight of ``(score_chosen + score_rejected)^2`` per pair added to the loss,
            which pulls the scores towards mean zero (Eisenstein et al. 2023; TRL's ``RewardConfig`` option of
            the same name, where 0.01 is suggested); 0 adds nothing.
    """

    center_rewards_coefficient: float = 0.0

    def __post_init__(self) -> None:
        if not self.center_rewards_coefficient >= 0:
            raise ConfigError(
                f"rm.center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}."
            )


__all__ = ["DPO_LOSS_TYPES", "DPOLossConfig", "PolicyLossConfig", "RewardLossConfig", "ValueLossConfig"]
