"""Create an engine from typed configs, or an engine config from plain values, through the registered plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._capabilities import refuse_missing_capabilities
from ._config import (
    CheckpointConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    OptimizerConfig,
    config_from_dict,
)
from ._errors import PluginError
from ._plugins import DrivetrainPlugins
from ._plugins import plugins as default_plugins

if TYPE_CHECKING:
    from ._engine import Engine

DEFAULT_BACKEND = "fsdp"


def create_engine(
    *,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    optimizer_config: OptimizerConfig | None = None,
    checkpoint_config: CheckpointConfig | None = None,
    plugins: DrivetrainPlugins | None = None,
) -> Engine:
    """Build (not initialise) the engine registered for ``(model_type, backend, device)``.

    Args:
        model_config: the model; its ``model_type`` selects the engine.
        engine_config: the backend's config (``backend`` and ``device`` select the engine).
        optimizer_config: ``None`` builds an inference-only engine.
        checkpoint_config: checkpoint contents and retention.
        plugins: the loaded plugins to look in; default: the process-wide :func:`~.plugins.plugins`.

    Returns:
        The engine; call ``initialize()`` on it next.

    Raises:
        PluginError: no engine is registered for the key (the message says what is and what to install), or the
            registered class's ``backend_name`` is not the backend it is registered for.
        ConfigError: ``engine_config`` is not the backend's config class, or the configs ask for a capability
            the backend does not declare (one error naming the backend, each capability and its option).
    """
    loaded = plugins or default_plugins()
    registry = loaded.engines
    engine_cls = registry.get(model_config.model_type, engine_config.backend, engine_config.device)
    if engine_cls.backend_name != engine_config.backend:
        # NOTE: checkpoints record backend_name, and ckpt merge/verify find the backend's merger by it: an engine
        # that left it unset ("") trained and saved, and its checkpoints could not be merged.
        raise PluginError(
            f"{engine_cls.__module__}.{engine_cls.__qualname__} is registered for backend {engine_config.backend!r} "
            f"but its backend_name is {engine_cls.backend_name!r}; checkpoints record backend_name and the "
            f"checkpoint tools look the backend up by it. Set backend_name = {engine_config.backend!r} on the class."
        )
    expected = registry.config_class(engine_config.backend)
    if not isinstance(engine_config, expected):
        raise ConfigError(
            f"backend {engine_config.backend!r} needs a {expected.__module__}.{expected.__qualname__}, got "
            f"{type(engine_config).__qualname__}; build it with engine_config_from_dict({{'backend': "
            f"{engine_config.backend!r}, ...}}) or {expected.__qualname__}(...)."
        )
    refuse_missing_capabilities(
        engine_config.backend, engine_cls.capabilities, model_config, engine_config, optimizer_config
    )
    return engine_cls(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=checkpoint_config,
        mergers=loaded.mergers.get,
    )


def engine_config_from_dict(
    values: dict[str, Any], *, plugins: DrivetrainPlugins | None = None
) -> EngineConfig:
    """Build the engine config of ``values["backend"]`` (default ``fsdp``) from plain values, as read from YAML.

    Args:
        values: the ``engine`` section; backend-specific keys are checked against the backend's config class.
        plugins: the loaded plugins to look in; default: the process-wide :func:`~.plugins.plugins`.

    Raises:
        PluginError: the backend is not installed.
        ConfigError: a key is unknown to the backend's config class or a value is invalid.
    """
    backend = values.get("backend", DEFAULT_BACKEND)
    config_cls = (plugins or default_plugins()).engines.config_class(backend)
    return config_from_dict(config_cls, {**values, "backend": backend}, where="engine")


__all__ = ["DEFAULT_BACKEND", "create_engine", "engine_config_from_dict"]
