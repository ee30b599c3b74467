"""The toy backend's engine config: the core settings with ``backend`` defaulting to ``toy``."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.config import ConfigError, EngineConfig


@dataclass(kw_only=True, frozen=True)
class ToyEngineConfig(EngineConfig):
    """Core engine settings; the toy backend adds none of its own, and refuses those it does not implement
    (low-precision compute, offload) rather than ignore them."""

    backend: str = "toy"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.param_dtype != "float32":
            raise ConfigError(
                f"engine.param_dtype={self.param_dtype!r}: the toy backend computes in float32 only; set "
                "engine.param_dtype=float32 or use the fsdp backend."
            )
        if self.param_offload or self.optimizer_offload:
            raise ConfigError(
                "engine.param_offload/optimizer_offload: the toy backend keeps everything on its device; set both "
                "to false or use the fsdp backend."
            )
