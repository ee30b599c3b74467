"""The toy backend's engine config: the core settings with ``backend`` defaulting to ``toy``."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.backend import EngineConfig


@dataclass(kw_only=True, frozen=True)
class ToyEngineConfig(EngineConfig):
    """Core engine settings; the toy backend adds none of its own. What it does not implement (low-precision
    compute, offload, LoRA) it does not declare in ``ToyEngine.capabilities``, and core refuses those options."""

    backend: str = "toy"
