"""Shared mechanics of the registrars: keyed entries, the plugin currently registering, duplicates."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from .._errors import PluginError
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

    def resolve(self, what: str, base: str | None = None) -> type:
        """Import the target (on first use) and check that it subclasses ``base``.

        Args:
            what: What the target is, for messages (``"engine"``, ``"rollout"``).
            base: ``"module:attr"`` of the class the target must subclass, as plugin authors import it (a face
                of core, such as ``"drivetrain_engine_core.backend:Engine"``): the refusal names it so.

        Raises:
            PluginError: the target cannot be imported, or is not a subclass of ``base``; names the plugin.
        """
        cls = resolve_target(self.target, what=what, source=self.source)
        if base is None:
            return cls
        if not issubclass(cls, resolve_target(base, what="base class", source=self.source)):
            module, _, name = base.partition(":")
            raise PluginError(
                f"{what} {self.path}, registered by {self.source.describe()}, does not subclass "
                f"{module}.{name}; subclass it (from {module} import {name})."
            )
        return cls


class KeyedRegistry:
    """Entries keyed by a tuple of strings; the plugin manager says which plugin is registering.

    Subclasses expose typed ``register``/``get`` methods and build their own error messages. A key that two
    plugins register is a conflict: both keep their other registrations, and looking the key up fails with
    an error naming both distributions, so no plugin can silently replace (or withdraw) another's.
    """

    kind: ClassVar[str] = "entry"
    """Word used in messages and listings (``engine``, ``role``, ``merger``)."""

    def __init__(self) -> None:
        self._entries: dict[Key, Registration] = {}
        self._conflicts: dict[Key, list[Registration]] = {}
        self._source = DIRECT_SOURCE
        self._failures: list[str] = []
        self._blocked: list[PluginSource] = []

    def note_failed_plugin(self, line: str) -> None:
        """Remember a plugin that failed to load, so "not found" errors can point at the likely cause."""
        self._failures.append(line)

    def note_blocked_plugin(self, source: PluginSource) -> None:
        """Remember a plugin blocked by ``DRIVETRAIN_DISABLE_PLUGINS``, so "not found" errors say so."""
        self._blocked.append(source)

    def _failure_hint(self) -> str:
        hint = ""
        if self._failures:
            hint += f" Plugins that failed to load (see `drivetrain plugins`): {'; '.join(self._failures)}."
        if self._blocked:
            blocked = ", ".join(f"{s.name} ({s.describe()})" for s in self._blocked)
            hint += (
                f" Plugins blocked by DRIVETRAIN_DISABLE_PLUGINS: {blocked}; remove a name from that variable "
                "to load it."
            )
        return hint

    def blocked_source(self, name: str) -> PluginSource | None:
        """The blocked plugin that likely provides ``name`` (same entry-point name, or its distribution)."""
        for source in self._blocked:
            if name in (source.name, source.distribution.removeprefix("drivetrain-engine-")):
                return source
        return None

    def conflicts(self) -> list[str]:
        """One line per key that several plugins registered (lookups of those keys fail)."""
        return [str(conflict_error(self.kind, key, regs)) for key, regs in sorted(self._conflicts.items())]

    def _lookup(self, key: Key) -> Registration | None:
        """The registration of ``key``, ``None`` when there is none.

        Raises:
            PluginError: several plugins registered ``key``; names them all.
        """
        if key in self._conflicts:
            raise conflict_error(self.kind, key, self._conflicts[key])
        return self._entries.get(key)

    @contextmanager
    def registering_as(self, source: PluginSource) -> Iterator[None]:
        """Attribute every registration made inside the block to ``source`` (used by the plugin manager)."""
        previous, self._source = self._source, source
        try:
            yield
        finally:
            self._source = previous

    def remove_source(self, plugin_name: str) -> None:
        """Drop everything a plugin registered, so a plugin that failed half-way contributes nothing.

        A conflict the plugin was part of is settled in favour of the remaining registration.
        """
        self._entries = {k: r for k, r in self._entries.items() if r.source.name != plugin_name}
        for key, registrations in list(self._conflicts.items()):
            remaining = [r for r in registrations if r.source.name != plugin_name]
            if len(remaining) > 1:
                self._conflicts[key] = remaining
                continue
            del self._conflicts[key]
            if remaining:
                self._entries[key] = remaining[0]

    def registered_by(self, plugin_name: str) -> list[str]:
        """Human-readable lines of what one plugin registered, for ``drivetrain plugins``."""
        lines = [
            f"{self.kind} {'/'.join(r.key)} -> {r.path}"
            for r in self._entries.values()
            if r.source.name == plugin_name
        ]
        return lines + [
            f"{self.kind} {'/'.join(r.key)} -> {r.path} (CONFLICT: also registered by another plugin)"
            for registrations in self._conflicts.values()
            for r in registrations
            if r.source.name == plugin_name
        ]

    def _add(self, key: Key, target: type | str) -> None:
        validate_target(target, f"{self.kind} {'/'.join(key)}")
        new = Registration(key=key, target=target, source=self._source)
        if key in self._conflicts:
            self._conflicts[key].append(new)
            return
        existing = self._entries.get(key)
        if existing is None:
            self._entries[key] = new
        elif existing.source.name == new.source.name:
            raise duplicate_error(self.kind, key, new.source)
        else:
            self._conflicts[key] = [self._entries.pop(key), new]


def conflict_error(kind: str, key: Key, registrations: list[Registration]) -> PluginError:
    """The error for a key that several plugins registered: no precedence, the user picks one."""
    who = " and by ".join(
        f"{r.source.describe()} (plugin {r.source.name!r}, {r.path})" for r in registrations
    )
    names = " or ".join(r.source.name for r in registrations)
    return PluginError(
        f"{kind} {'/'.join(key)} is registered by several plugins: by {who}. drivetrain picks none of them: "
        f"uninstall the one you do not want, or block it with DRIVETRAIN_DISABLE_PLUGINS=<name> ({names})."
    )


def duplicate_error(kind: str, key: Key, source: PluginSource) -> PluginError:
    """The error for one plugin registering a key twice: its own hook's bug (another plugin's is a conflict)."""
    return PluginError(
        f"plugin {source.name!r} ({source.describe()}) registers {kind} {'/'.join(key)} twice; each key is "
        "registered once: fix the plugin's hook (or report it to its authors), or block it with "
        f"DRIVETRAIN_DISABLE_PLUGINS={source.name}."
    )
