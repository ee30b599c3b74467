"""A plugin without an installed distribution, for tests that go through core's real plugin loading.

``get_plugin_manager(entry_points=[InMemoryEntryPoint(...)], disabled=[])`` loads it as it would an installed
one: the same validation, registrar hooks, ``drivetrain plugins`` listing and core-range check, without writing
a package to disk or touching the environment's installed entry points.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass(kw_only=True, frozen=True)
class InMemoryEntryPoint:
    """An entry point of group ``drivetrain`` whose ``load()`` returns a ready plugin object.

    Attributes:
        name: the entry-point name (what ``DRIVETRAIN_DISABLE_PLUGINS`` blocks).
        distribution: the distribution that declares it, as ``drivetrain plugins`` lists it.
        plugin: what ``load()`` returns: an object whose attributes are hook implementations, e.g.
            ``SimpleNamespace(register_engines=register)``; an exception is raised instead, as a plugin whose
            import fails does.
        version: the distribution's version.
        requires: the distribution's ``Requires-Dist`` lines (its core range is read from them).
        value: the entry point's ``module:attr`` text, shown in listings.
    """

    name: str
    distribution: str
    plugin: Any
    version: str = "0.1.0"
    requires: tuple[str, ...] = ()
    value: str = "in_memory"

    @property
    def dist(self) -> SimpleNamespace:
        """The declaring distribution, as ``importlib.metadata`` describes it."""
        return SimpleNamespace(name=self.distribution, version=self.version, requires=list(self.requires))

    def load(self) -> Any:
        """The plugin object, or its exception raised."""
        if isinstance(self.plugin, BaseException):
            raise self.plugin
        return self.plugin
