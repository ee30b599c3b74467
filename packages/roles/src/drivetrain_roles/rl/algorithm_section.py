"""The fields an RL command's ``algorithm`` section shares (``grpo``, ``ppo``): the policy loss, the update's
mini-batches, the reward function and its overlong penalty; one loss, one set of checks.

:class:`AlgorithmSection` declares no dataclass fields of its own: each command's ``algorithm`` dataclass
declares them in its own order (with its help text) and inherits the checks and the loss built from them, so
``drivetrain grpo`` and ``drivetrain ppo`` read ``algorithm.clip_ratio`` and the rest the same way.
"""

from __future__ import annotations

from typing import ClassVar

from drivetrain_engine_core.backend import ConfigError

from ..losses.config import PolicyLossConfig
from ..losses.names import CONSTANT_LENGTH_MODE
from .reward_settings import REWARD_FIELDS, RewardSettings, reward_settings


class AlgorithmSection:
    """The shared fields' checks and the actor's loss, from an ``algorithm`` section's verl-named fields (their help:
    the commands' ``Attributes:``)."""

    loss_mode: str
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    clip_ratio_c: float | None
    kl_loss_coef: float
    kl_estimator: str
    loss_agg_mode: str
    loss_scale_factor: int | None
    overlong_buffer_len: int
    overlong_penalty_factor: float
    ppo_mini_batches: int
    ppo_epochs: int
    reward_function: str | None
    reward_functions: tuple[str, ...] | None
    reward_weights: tuple[float, ...] | None
    reward_timeout_s: float | None
    reward_failure_value: float | None

    exclusive_fields: ClassVar[tuple[str, ...]] = REWARD_FIELDS
    """Setting one form of the reward in a config layer clears the other (:mod:`.reward_settings`)."""

    def _check_shared_fields(self) -> None:
        """The checks of the fields above, each naming the field and the fix.

        Raises:
            ConfigError: a value out of range, an unknown name (the known ones and the closest), rewards that do
                not resolve (:func:`.reward_settings.reward_settings`), or ``loss_scale_factor`` without the
                mode that reads it.
        """
        self.rewards()
        for option in ("ppo_mini_batches", "ppo_epochs"):
            if getattr(self, option) < 1:
                raise ConfigError(f"algorithm.{option} must be >= 1, got {getattr(self, option)}.")
        if self.overlong_buffer_len < 0 or self.overlong_penalty_factor < 0:
            raise ConfigError(
                "algorithm.overlong_buffer_len and algorithm.overlong_penalty_factor must be >= 0."
            )
        if not 0 < self.clip_ratio < 1:
            raise ConfigError(f"algorithm.clip_ratio must be in (0, 1), got {self.clip_ratio}.")
        if self.loss_scale_factor is not None and self.loss_agg_mode != CONSTANT_LENGTH_MODE:
            raise ConfigError(
                f"algorithm.loss_scale_factor={self.loss_scale_factor} is read only by loss_agg_mode="
                f"{CONSTANT_LENGTH_MODE}, not {self.loss_agg_mode!r}; unset it or set that mode."
            )
        try:
            self.policy_loss(max_new_tokens=1)
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from e

    def rewards(self) -> RewardSettings:
        """The reward functions, their weights, time limit and failure value, resolved from either form."""
        return reward_settings(
            self.reward_function,
            self.reward_functions,
            self.reward_weights,
            self.reward_timeout_s,
            self.reward_failure_value,
        )

    def policy_loss(self, *, max_new_tokens: int) -> PolicyLossConfig:
        """The actor's loss; ``max_new_tokens`` is the constant length unless ``loss_scale_factor`` is set."""
        return PolicyLossConfig(
            loss_mode=self.loss_mode,
            clip_ratio_low=self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
            loss_scale_factor=self.loss_scale_factor or max_new_tokens,
            kl_loss_coef=self.kl_loss_coef,
            kl_estimator=self.kl_estimator,
        )
