"""drivetrain-engine-core: the backend-agnostic Engine contract, data format, plugins and CLI.

Importing the package is cheap: configs and errors load eagerly, everything that needs torch (the Engine,
outputs, the factory) loads on first attribute access, so listing plugins never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import (
    CheckpointConfig,
    ConfigError,
    EngineConfig,
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
    config_from_dict,
)
from .errors import BatchError, CheckpointError, DrivetrainError, EngineStateError, PluginError
from .lazy import lazy_getattr
from .upstream_noise import silence_upstream_noise

if TYPE_CHECKING:
    from .engine import Engine
    from .factory import create_engine, engine_config_from_dict
    from .outputs import ForwardBackwardOutput, LossContext, LossFn, MicroBatchResult
    from .plugins import get_plugin_manager

_LAZY = {
    "Engine": "engine",
    "ForwardBackwardOutput": "outputs",
    "LossContext": "outputs",
    "LossFn": "outputs",
    "MicroBatchResult": "outputs",
    "create_engine": "factory",
    "engine_config_from_dict": "factory",
    "get_plugin_manager": "plugins",
}

__version__ = "0.1.0"

silence_upstream_noise()  # one known upstream log record, dropped at its logger (see upstream_noise)

__all__ = [
    "BatchError",
    "CheckpointConfig",
    "CheckpointError",
    "ConfigError",
    "DrivetrainError",
    "Engine",
    "EngineConfig",
    "EngineStateError",
    "ForwardBackwardOutput",
    "LoraConfig",
    "LossContext",
    "LossFn",
    "MicroBatchConfig",
    "MicroBatchResult",
    "ModelConfig",
    "OptimizerConfig",
    "PluginError",
    "config_from_dict",
    "create_engine",
    "engine_config_from_dict",
    "get_plugin_manager",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
