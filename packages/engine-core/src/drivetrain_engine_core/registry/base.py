"""Shared mechanics of the registrars: keyed entries, the plugin currently registering, duplicates."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from ..errors import PluginError
from .source import DIRECT_SOURCE, PluginSource, resolve_target, target_path, validate_target

Key = tuple[str, ...]


@dataclass(kw_only=True, frozen=True)
class Registration:
    """One registered target under one key, with the plugin that registered it."""

    key: Key
    target: type | str
    source: PluginSource

    @property
    def path(self) -> str:
        """``"module:attr"`` of the target, computed without importing it."""
        return target_path(self.target)

    def resolve(self, what: str, base: type | None = None) -> type:
        """Import the target (on first use) and check that it subclasses ``base``.

        Raises:
            PluginError: the target cannot be imported, or is not a subclass of ``base``; names the plugin.
        """
        cls = resolve_target(self.target, what=what, source=self.source)
        if base is not None and not issubclass(cls, base):
            raise PluginError(
                f"{what} {self.path}, registered by {self.source.describe()}, does not subclass "
                f"{base.__module__}.{base.__qualname__}."
            )
        return cls


class KeyedRegistry:
    """Entries keyed by a tuple of strings; the plugin manager says which plugin is registering.

    Subclasses expose typed ``register``/``get`` methods and build their own error messages.
    """

    kind: ClassVar[str] = "entry"
    """Word used in messages and listings (``engine``, ``role``, ``merger``)."""

    def __init__(self) -> None:
        self._entries: dict[Key, Registration] = {}
        self._source = DIRECT_SOURCE
        self._failures: list[str] = []

    def note_failed_plugin(self, line: str) -> None:
        """Remember a plugin that failed to load, so "not found" errors can point at the likely cause."""
        self._failures.append(line)

    def _failure_hint(self) -> str:
        if not self._failures:
            return ""
        return f" Plugins that failed to load (see `drivetrain plugins`): {'; '.join(self._failures)}."

    @contextmanager
    def registering_as(self, source: PluginSource) -> Iterator[None]:
        """Attribute every registration made inside the block to ``source`` (used by the plugin manager)."""
        previous, self._source = self._source, source
        try:
            yield
        finally:
            self._source = previous

    def remove_source(self, plugin_name: str) -> None:
        """Drop everything a plugin registered, so a plugin that failed half-way contributes nothing."""
        self._entries = {k: r for k, r in self._entries.items() if r.source.name != plugin_name}

    def registered_by(self, plugin_name: str) -> list[str]:
        """Human-readable lines of what one plugin registered, for ``drivetrain plugins``."""
        return [
            f"{self.kind} {'/'.join(r.key)} -> {r.path}"
            for r in self._entries.values()
            if r.source.name == plugin_name
        ]

    def _add(self, key: Key, target: type | str) -> None:
        validate_target(target, f"{self.kind} {'/'.join(key)}")
        existing = self._entries.get(key)
        if existing is not None:
            raise duplicate_error(self.kind, key, existing.source, self._source)
        self._entries[key] = Registration(key=key, target=target, source=self._source)


def duplicate_error(kind: str, key: Key, first: PluginSource, second: PluginSource) -> PluginError:
    """The error for one key registered twice, naming both distributions and how to choose one."""
    return PluginError(
        f"{kind} {'/'.join(key)} is registered twice: by {first.describe()} (plugin {first.name!r}) and by "
        f"{second.describe()} (plugin {second.name!r}). Uninstall one of them or block one with "
        f"DRIVETRAIN_DISABLE_PLUGINS={second.name}."
    )
