"""Loading plugins: import each ``drivetrain`` entry point, validate it with pluggy, attribute a failure.

Calling the hooks of loaded plugins is :mod:`drivetrain_engine_core._plugins`' job; this module only turns
entry points into registered pluggy plugins and records, per plugin, what happened (:class:`PluginInfo`).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import pluggy

from ._plugin_compat import core_incompatibility, installed_core_version
from ._registry import PluginSource

DISABLE_ENV = "DRIVETRAIN_DISABLE_PLUGINS"
"""Comma-separated entry-point names that operators block from loading."""

PluginStatus = Literal["loaded", "failed", "blocked", "incompatible"]


class EntryPointLike(Protocol):
    """What discovery needs from an entry point (``importlib.metadata.EntryPoint`` or a test double)."""

    name: str
    value: str

    @property
    def dist(self) -> Any: ...

    def load(self) -> Any: ...


@dataclass(kw_only=True, frozen=True)
class PluginInfo:
    """What ``drivetrain plugins`` reports about one plugin.

    Attributes:
        name: entry-point name (the name to block with ``DRIVETRAIN_DISABLE_PLUGINS``).
        distribution, version: the installed distribution that declares it.
        status: ``loaded``, ``failed``, ``blocked`` or ``incompatible`` (its core range does not admit the
            installed core; never imported).
        error: the original exception, formatted on one line, or why it is incompatible (``None`` otherwise).
        traceback: the full formatted traceback of that exception, for debugging.
        registered: lines such as ``"engine language_model/fsdp/cpu -> pkg.mod:Cls"``.
    """

    name: str
    distribution: str
    version: str
    status: PluginStatus
    error: str | None = None
    traceback: str | None = None
    registered: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON output."""
        return dataclasses.asdict(self)


def source_of(entry_point: EntryPointLike) -> PluginSource:
    dist = entry_point.dist
    if dist is None:
        return PluginSource(name=entry_point.name, distribution="<unknown distribution>", version="")
    return PluginSource(name=entry_point.name, distribution=dist.name, version=dist.version)


def new_info(source: PluginSource, status: PluginStatus, error: str | None = None) -> PluginInfo:
    return PluginInfo(
        name=source.name, distribution=source.distribution, version=source.version, status=status, error=error
    )


def format_exception(error: BaseException) -> tuple[str, str]:
    summary = "".join(traceback.format_exception_only(type(error), error)).strip()
    return summary, "".join(traceback.format_exception(error))


def disabled_from_env() -> set[str]:
    """Entry-point names listed in ``DRIVETRAIN_DISABLE_PLUGINS`` (empty names ignored)."""
    return {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}


def load_entry_point(
    manager: pluggy.PluginManager,
    infos: dict[str, PluginInfo],
    entry_point: EntryPointLike,
    disabled: set[str],
) -> Exception | None:
    """Import ``entry_point`` and register it with ``manager``, recording its :class:`PluginInfo` in ``infos``.

    A name declared twice is recorded as failed under a suffixed key; a blocked name is recorded as blocked; a
    plugin whose distribution requires a core range that the installed core is outside of is recorded as
    incompatible and not imported (:mod:`.plugin_compat`).

    Returns:
        The exception the import or pluggy's validation raised (the caller withdraws the plugin), else None.
    """
    source = source_of(entry_point)
    if entry_point.name in infos:
        first = infos[entry_point.name]
        error = (
            f"plugin name {entry_point.name!r} is declared by both {first.distribution} {first.version} and "
            f"{source.describe()}; uninstall one of them."
        )
        infos[f"{entry_point.name}#{len(infos)}"] = new_info(source, "failed", error)
        return None
    if entry_point.name in disabled:
        manager.set_blocked(entry_point.name)
        infos[entry_point.name] = new_info(source, "blocked")
        return None
    incompatible = core_incompatibility(entry_point.dist, installed_core_version())
    if incompatible is not None:
        infos[entry_point.name] = new_info(source, "incompatible", incompatible)
        return None
    infos[entry_point.name] = new_info(source, "loaded")
    try:
        manager.register(entry_point.load(), name=entry_point.name)
        # Checked per plugin so that an unknown hook name is blamed on the plugin that declared it.
        manager.check_pending()
    except Exception as e:
        return e
    return None


def problem_line(info: PluginInfo) -> str | None:
    """The line every command prints on stderr about a plugin that failed or is incompatible, else None."""
    if info.status == "failed":
        return f"plugin {info.name!r} ({info.distribution} {info.version}) failed to load: {info.error}"
    if info.status == "incompatible":
        return f"plugin {info.name!r} ({info.distribution} {info.version}) is incompatible: {info.error}"
    return None


def failed(info: PluginInfo, error: Exception, hook: str | None = None) -> PluginInfo:
    """``info`` marked failed with ``error`` (one line, prefixed by the ``hook`` it raised in) and its traceback."""
    summary, full = format_exception(error)
    return dataclasses.replace(
        info, status="failed", error=f"{hook}: {summary}" if hook else summary, traceback=full
    )
