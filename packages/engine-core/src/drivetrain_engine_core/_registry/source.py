"""Who registered something, and the lazily imported ``"module:attr"`` targets registrations may name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .._errors import PluginError


@dataclass(kw_only=True, frozen=True)
class PluginSource:
    """The plugin a registration came from, so errors and listings can name the distribution to fix.

    Attributes:
        name: entry-point name of the plugin (``fsdp``, ``roles``, ...), the name used to block it.
        distribution: the installed distribution that declares the entry point.
        version: that distribution's version.
    """

    name: str
    distribution: str
    version: str

    def describe(self) -> str:
        """``"drivetrain-engine-fsdp 0.1.0"``: what a user would look for in ``pip list``."""
        return f"{self.distribution} {self.version}".strip()


DIRECT_SOURCE = PluginSource(name="<direct>", distribution="<registered in code>", version="")
"""Source of registrations made outside any plugin hook (tests, scripts)."""


def target_path(target: type | str) -> str:
    """The ``"module:attr"`` path of a class or of a lazy string target, without importing anything."""
    if isinstance(target, str):
        return target
    return f"{target.__module__}:{target.__qualname__}"


def validate_target(target: object, what: str) -> None:
    """Reject a target that is neither a class nor a well-formed ``"module:attr"`` string, at registration.

    Raises:
        PluginError: the target is malformed; the message names ``what`` was being registered.
    """
    if isinstance(target, type):
        return
    if isinstance(target, str) and target.count(":") == 1 and all(target.split(":")):
        return
    raise PluginError(
        f"{what}: expected a class or a 'module:attr' string such as 'my_pkg.engine:MyEngine', got {target!r}."
    )


def resolve_target(target: type | str, *, what: str, source: PluginSource) -> type:
    """Import a lazy ``"module:attr"`` target (or return a class as is).

    Raises:
        PluginError: the module or attribute cannot be imported; names the registering distribution.
    """
    if isinstance(target, type):
        return target
    module_name, _, attr_path = target.partition(":")
    try:
        value: object = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            value = getattr(value, attr)
    except PluginError:
        raise  # the plugin's own word on what it is missing (an optional library) and how to install it
    except Exception as e:
        raise PluginError(
            f"{what} {target!r}, registered by {source.describe()} (plugin {source.name!r}), cannot be "
            f"imported: {type(e).__name__}: {e}. Reinstall {source.distribution} or check its dependencies."
        ) from e
    if not isinstance(value, type):
        raise PluginError(
            f"{what} {target!r}, registered by {source.describe()}, is a {type(value).__name__}, not a class."
        )
    return value
