"""drivetrain's PyTorch FSDP2 engine over Hugging Face transformers models.

Import the engine from :mod:`drivetrain_engine_fsdp.engine` (heavy: torch, transformers); this package
``__init__`` stays light so that plugin discovery does not pay for it.
"""

__all__ = ["FSDPEngine", "FSDPEngineConfig"]


def __getattr__(name: str):
    if name == "FSDPEngine":
        from .engine import FSDPEngine

        return FSDPEngine
    if name == "FSDPEngineConfig":
        from .config import FSDPEngineConfig

        return FSDPEngineConfig
    raise AttributeError(f"module 'drivetrain_engine_fsdp' has no attribute {name!r}")
