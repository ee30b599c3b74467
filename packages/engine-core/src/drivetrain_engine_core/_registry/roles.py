"""The role registrar: role name (``actor``, ``critic``, ``sft``, ...) -> role class."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .._errors import PluginError
from .base import KeyedRegistry


@dataclass(kw_only=True, frozen=True)
class NamedEntry:
    """One registered role or merger: its name, target path and the distribution that registered it."""

    name: str
    target: str
    plugin: str
    distribution: str
    version: str


class NamedRegistry(KeyedRegistry):
    """Classes registered under one name each; the base of the role and merger registrars."""

    install_hint: str = ""
    """Install command suggested when a name is missing."""

    required_base: str | None = None
    """``"module:attr"`` of the class every target must subclass, imported only on ``get``."""

    example: str = ""
    """A name of this kind, for the message refusing an empty one (``hf``)."""

    def register(self, name: str, target: type | str) -> None:
        """Register ``target`` (a class or ``"module:attr"``) under ``name`` (a role, rollout or environment
        name; a merger's backend).

        Raises:
            PluginError: the name is empty or already registered, or ``target`` is malformed.
        """
        if not name:
            raise PluginError(
                f"{self.kind}: the name is empty; register it under a name such as {self.example!r}."
            )
        self._add((name,), target)

    def get(self, name: str) -> type:
        """The class registered under ``name``, imported on first use.

        Raises:
            PluginError: nothing registered under ``name`` (lists what is, with the install hint), or it cannot
                be imported.
        """
        return self._get(name)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(key[0] for key in self._entries)

    def entries(self) -> list[NamedEntry]:
        """Every registration, without importing anything."""
        return [
            NamedEntry(
                name=key[0],
                target=registration.path,
                plugin=registration.source.name,
                distribution=registration.source.distribution,
                version=registration.source.version,
            )
            for key, registration in sorted(self._entries.items())
        ]

    def _get(self, name: str) -> type:
        registration = self._lookup((name,))
        if registration is None:
            registered = ", ".join(
                f"{key[0]} ({registration.source.describe()})"
                for key, registration in sorted(self._entries.items())
            )
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PluginError(
                f"no {self.kind} named {name!r} is registered; registered: {registered or 'none'}.{hint}"
                f"{self._failure_hint()} "
                f"Install the plugin that provides it, e.g. {self.install_hint}."
            )
        return registration.resolve(self.kind, self.required_base)


class RoleRegistry(NamedRegistry):
    """Role classes by name; a role may be a lazy ``"module:attr"`` string."""

    kind = "role"
    install_hint = "pip install drivetrain-roles"
    example = "actor"
