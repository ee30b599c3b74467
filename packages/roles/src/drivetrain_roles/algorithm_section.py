"""The fields an RL command's ``algorithm`` section shares (``grpo``, ``ppo``): the policy loss, the update's
mini-batches, the reward function and its overlong penalty; one loss, one set of checks.

:class:`AlgorithmSection` declares no dataclass fields of its own: each command's ``algorithm`` dataclass
declares them in its own order (with its help text) and inherits the checks and the loss built from them, so
``drivetrain grpo`` and ``drivetrain ppo`` read ``algorithm.clip_ratio`` and the rest the same way.
"""

from __future__ import annotations

from drivetrain_engine_core.config import ConfigError

from .grpo.builtin_rewards import BUILTIN_REWARDS
from .losses.config import PolicyLossConfig
from .losses.names import CONSTANT_LENGTH_MODE


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
    reward_function: str

    def _check_shared_fields(self) -> None:
        """The checks of the fields above, each naming the field and the fix.

        Raises:
            ConfigError: a value out of range, an unknown name (the known ones and the closest), a reward function
                written without its name, or ``loss_scale_factor`` without the mode that reads it.
        """
        location, _, name = self.reward_function.rpartition(":")
        if self.reward_function not in BUILTIN_REWARDS and not (location and name):
            raise ConfigError(
                f"algorithm.reward_function={self.reward_function!r}: write {' or '.join(BUILTIN_REWARDS)} (built in), "
                "package.module:function or path/to/file.py:function."
            )
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
