"""Which advantage estimator a job uses, and its settings (:mod:`.advantage_estimators` computes them).

Imports no torch: the ``algorithm`` sections of ``grpo`` and ``ppo`` check these when their config is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError

from ..losses.names import choose

OUTCOME_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
"""The estimators that need no critic."""
CRITIC_ESTIMATORS: tuple[str, ...] = ("gae",)
ADV_ESTIMATORS: tuple[str, ...] = (*OUTCOME_ESTIMATORS, *CRITIC_ESTIMATORS)
_DISCOUNTED = ("reinforce_plus_plus", "gae")


@dataclass(kw_only=True, frozen=True)
class AdvantageConfig:
    """Which estimator, and the settings it reads.

    Attributes:
        adv_estimator: one of :data:`ADV_ESTIMATORS` (verl's names; ``dr_grpo`` is ``grpo`` without the division).
        epsilon: added to the group's standard deviation before dividing (``grpo``).
        scale_by_std: ``grpo`` only: divide by the group's deviation (``None``: yes); verl's
            ``norm_adv_by_std_in_grpo``, TRL's ``scale_rewards``.
        gamma: discount per loss token (``reinforce_plus_plus``, ``gae``); the others take no discount.
    """

    adv_estimator: str = "grpo"
    epsilon: float = 1e-6
    scale_by_std: bool | None = None
    gamma: float = 1.0

    def __post_init__(self) -> None:
        name = choose("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        if self.scale_by_std is not None and name != "grpo":
            fix = (
                "use adv_estimator=grpo" if name == "dr_grpo" and self.scale_by_std else "unset scale_by_std"
            )
            raise ConfigError(
                f"scale_by_std={self.scale_by_std} with adv_estimator={name!r}: only grpo reads it (dr_grpo is "
                f"grpo with scale_by_std=false); {fix}."
            )
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma}.")
        if self.gamma != 1 and name not in _DISCOUNTED:
            raise ConfigError(
                f"gamma={self.gamma} with adv_estimator={name!r}: only {' and '.join(_DISCOUNTED)} discount; "
                "unset gamma or choose adv_estimator=reinforce_plus_plus."
            )

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator in CRITIC_ESTIMATORS


__all__ = ["ADV_ESTIMATORS", "CRITIC_ESTIMATORS", "OUTCOME_ESTIMATORS", "AdvantageConfig"]
