"""The ``reward_model`` section of ``drivetrain grpo`` and ``drivetrain ppo``: how the reward models named in
``algorithm.reward_functions`` (:mod:`.spec`) run (torch-free).

Each reward model gets its own inference-only engine of the job's ``engine`` section (its backend, device,
dtype and parallel layout, as PPO's critic does), so its data-parallel ranks are the actor's and each rank
scores its own completions. This section changes only what a forward-only model needs otherwise: its
micro-batches, and whether its weights leave the device between steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from drivetrain_engine_core.backend import ConfigError, EngineConfig
from drivetrain_engine_core.job import MicroBatchConfig


@dataclass(kw_only=True, frozen=True)
class RewardModelConfig:
    """How reward models run (each on its own engine of the job's ``engine`` section).

    Attributes:
        micro_batch_size: sequences per forward micro-batch (``null`` with ``max_tokens`` unset: the
            ``engine`` section's micro-batches).
        max_tokens: tokens per forward micro-batch instead (dynamic batching).
        param_offload: keep the reward model's weights off the device between its forwards (``null``: wherever
            the backend can offload, i.e. declares the ``offload`` capability).
    """

    micro_batch_size: int | None = None
    max_tokens: int | None = None
    param_offload: bool | None = None

    exclusive_fields: ClassVar[tuple[str, ...]] = ("micro_batch_size", "max_tokens")
    """Setting one of the micro-batch limits in a config layer clears the other."""

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and self.max_tokens is not None:
            raise ConfigError(
                f"reward_model.micro_batch_size={self.micro_batch_size} and reward_model.max_tokens="
                f"{self.max_tokens} are both set; set one (or neither: the engine section's micro-batches)."
            )
        for option in ("micro_batch_size", "max_tokens"):
            value = getattr(self, option)
            if value is not None and value < 1:
                raise ConfigError(f"reward_model.{option} must be >= 1 or null, got {value}.")

    def engine_config(self, engine: EngineConfig, *, can_offload: bool) -> EngineConfig:
        """The reward model's engine config: ``engine`` with this section's micro-batches and offload, and no
        optimizer state to offload."""
        micro_batch = engine.micro_batch
        if self.micro_batch_size is not None or self.max_tokens is not None:
            micro_batch = MicroBatchConfig(micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens)
        offload = can_offload if self.param_offload is None else self.param_offload
        return dataclasses.replace(
            engine, micro_batch=micro_batch, param_offload=offload, optimizer_offload=False
        )
