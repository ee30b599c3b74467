"""drivetrain's Megatron-Core backend: ``MegatronEngine`` on ``GPTModel`` built through mbridge.

Importing this package is cheap; megatron-core is imported by the engine modules when they are used.
"""

from .config import MegatronEngineConfig

__all__ = ["MegatronEngine", "MegatronEngineConfig"]


def __getattr__(name: str):
    if name == "MegatronEngine":
        from .engine import MegatronEngine

        return MegatronEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; it exports {__all__}")
