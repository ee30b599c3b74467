"""The engine registrar: ``(model_type, backend, device) -> Engine`` class, plus each backend's config class."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._config import MODEL_TYPES
from .._errors import PluginError
from .base import KeyedRegistry, Registration, conflict_error, duplicate_error
from .source import validate_target

if TYPE_CHECKING:
    from .._config import EngineConfig
    from .._engine import Engine

ANY_DEVICE = "*"
"""A device entry meaning "every device"; the only fallback from an exact device."""


@dataclass(kw_only=True, frozen=True)
class EngineEntry:
    """One row of ``drivetrain engines``: a key, the engine and config paths, and who registered them."""

    model_type: str
    backend: str
    device: str
    engine: str
    config: str
    plugin: str
    distribution: str
    version: str


class EngineRegistry(KeyedRegistry):
    """Engine classes by ``(model_type, backend, device)``; targets may be lazy ``"module:attr"`` strings."""

    kind = "engine"

    def __init__(self) -> None:
        super().__init__()
        self._configs: dict[str, Registration] = {}
        self._config_agreeing: dict[str, list[Registration]] = {}
        """Later registrations of a backend's config class that agree with ``_configs``' (several plugins adding
        model types to one backend): one takes over when the first plugin is withdrawn."""
        self._config_conflicts: dict[str, list[Registration]] = {}

    def register(
        self,
        *,
        model_type: str,
        backend: str,
        devices: Sequence[str],
        engine: type | str,
        config: type | str,
    ) -> None:
        """Register ``engine`` for ``model_type`` on ``backend`` for each of ``devices``.

        Args:
            model_type: ``language_model`` or ``value_model``.
            backend: backend name, matched against ``EngineConfig.backend``.
            devices: device types (``cpu``, ``cuda``, ...); ``"*"`` serves any device without an exact entry.
            engine: the ``Engine`` subclass or its ``"module:attr"`` path (imported on first ``get``).
            config: the backend's ``EngineConfig`` subclass or its ``"module:attr"`` path.

        Raises:
            PluginError: bad arguments, or a key (or the backend's config class) already registered.
        """
        where = f"engine {model_type}/{backend}"
        if model_type not in MODEL_TYPES:
            raise PluginError(f"{where}: model_type must be one of {list(MODEL_TYPES)}, got {model_type!r}.")
        if isinstance(devices, str) or not devices or not all(isinstance(d, str) and d for d in devices):
            raise PluginError(f"{where}: devices must be a non-empty list such as ['cpu', 'cuda'] or ['*'].")
        validate_target(config, f"{where} config")
        self._add_config(backend, config)
        for device in devices:
            self._add((model_type, backend, device), engine)

    def get(self, model_type: str, backend: str, device: str) -> type[Engine]:
        """The engine class for a key, importing it if it was registered lazily.

        Raises:
            PluginError: nothing is registered for the key (the message lists what is and how to install it),
                or the registered target cannot be imported or is not an ``Engine``.
        """
        registration = self._lookup((model_type, backend, device)) or self._lookup(
            (model_type, backend, ANY_DEVICE)
        )
        if registration is None:
            raise self._missing_error(model_type, backend, device)
        return registration.resolve("engine", "drivetrain_engine_core.backend:Engine")

    def config_class(self, backend: str) -> type[EngineConfig]:
        """The ``EngineConfig`` subclass of a backend, importing it if registered lazily.

        Raises:
            PluginError: the backend is not registered, or its config class cannot be imported.
        """
        if backend in self._config_conflicts:
            raise conflict_error("config class of backend", (backend,), self._config_conflicts[backend])
        registration = self._configs.get(backend)
        if registration is None:
            raise self._missing_error(None, backend, None)
        return registration.resolve("engine config", "drivetrain_engine_core.backend:EngineConfig")

    def backends(self) -> list[str]:
        """Registered backend names, sorted."""
        return sorted(self._configs)

    def entries(self) -> list[EngineEntry]:
        """Every registered key with engine and config paths and their distribution (nothing imported)."""
        return [
            EngineEntry(
                model_type=model_type,
                backend=backend,
                device=device,
                engine=registration.path,
                config=self._configs[backend].path if backend in self._configs else "<conflict>",
                plugin=registration.source.name,
                distribution=registration.source.distribution,
                version=registration.source.version,
            )
            for (model_type, backend, device), registration in sorted(self._entries.items())
        ]

    def conflicts(self) -> list[str]:
        own = [
            str(conflict_error("config class of backend", (backend,), registrations))
            for backend, registrations in sorted(self._config_conflicts.items())
        ]
        return super().conflicts() + own

    def remove_source(self, plugin_name: str) -> None:
        super().remove_source(plugin_name)
        self._config_agreeing = {
            backend: [r for r in registrations if r.source.name != plugin_name]
            for backend, registrations in self._config_agreeing.items()
        }
        for backend, registration in list(self._configs.items()):
            if registration.source.name != plugin_name:
                continue
            # NOTE: a withdrawn (failed) plugin took the config class with it, though another loaded plugin had
            # registered the same one: that plugin's engines were listed but could not be built.
            successors = self._config_agreeing.pop(backend, [])
            if successors:
                self._configs[backend], self._config_agreeing[backend] = successors[0], successors[1:]
            else:
                del self._configs[backend]
        for backend, registrations in list(self._config_conflicts.items()):
            remaining = [r for r in registrations if r.source.name != plugin_name]
            if len({r.path for r in remaining}) > 1:
                self._config_conflicts[backend] = remaining
                continue
            del self._config_conflicts[backend]
            if remaining:
                self._configs[backend] = remaining[0]

    def _add_config(self, backend: str, config: type | str) -> None:
        # Several plugins may add model types to one backend, as long as they agree on its config class.
        new = Registration(key=(backend,), target=config, source=self._source)
        if backend in self._config_conflicts:
            self._config_conflicts[backend].append(new)
            return
        existing = self._configs.setdefault(backend, new)
        if existing.path == new.path:
            if existing is not new and existing.source.name != new.source.name:
                self._config_agreeing.setdefault(backend, []).append(new)
            return
        if existing.source.name == new.source.name:
            raise duplicate_error("config class of backend", (backend,), self._source)
        agreeing = self._config_agreeing.pop(backend, [])
        self._config_conflicts[backend] = [self._configs.pop(backend), *agreeing, new]

    def _missing_error(self, model_type: str | None, backend: str, device: str | None) -> PluginError:
        asked = ", ".join(
            f"{name}={value!r}"
            for name, value in (("model_type", model_type), ("backend", backend), ("device", device))
            if value is not None
        )
        lines = [f"no engine is registered for {asked}."]
        lines.append(f"Registered engines: {self._describe_registered()}.{self._failure_hint()}")
        lines.extend(self._hints(model_type, backend, device))
        blocked = self.blocked_source(backend)
        if blocked is not None:
            lines.append(
                f"Backend {backend!r} is most likely provided by plugin {blocked.name!r} ({blocked.describe()}), "
                f"which is installed but blocked: remove {blocked.name!r} from DRIVETRAIN_DISABLE_PLUGINS."
            )
        else:
            lines.append(
                f"To add backend {backend!r}, install its plugin: pip install drivetrain-engine-{backend} "
                "(then check with `drivetrain engines`)."
            )
        return PluginError("\n".join(lines))

    def _describe_registered(self) -> str:
        if not self._entries:
            return (
                "none (no engine plugin is installed or every one failed to load; see `drivetrain plugins`)"
            )
        return ", ".join(
            f"{'/'.join(key)} ({registration.source.describe()})"
            for key, registration in sorted(self._entries.items())
        )

    def _hints(self, model_type: str | None, backend: str, device: str | None) -> list[str]:
        if backend not in self._configs:
            close = difflib.get_close_matches(backend, list(self._configs), n=1)
            return [f"Did you mean backend {close[0]!r}?"] if close else []
        keys = [k for k in self._entries if k[1] == backend]
        model_types = sorted({k[0] for k in keys})
        if model_type is not None and model_type not in model_types:
            return [f"Backend {backend!r} provides model types {model_types}, not {model_type!r}."]
        devices = sorted({k[2] for k in keys if k[0] == model_type})
        close = difflib.get_close_matches(device or "", devices, n=1)
        hint = f" Did you mean device {close[0]!r}?" if close else ""
        return [f"Backend {backend!r} supports devices {devices} for model_type {model_type!r}.{hint}"]
