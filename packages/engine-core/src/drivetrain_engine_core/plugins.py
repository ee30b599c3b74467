"""Plugin discovery: load the ``drivetrain`` entry points, isolate failures, fill the registrars.

:func:`get_plugin_manager` builds a fresh :class:`DrivetrainPlugins` (never at import); :func:`plugins` caches
one per process for library code and the CLI, and :func:`reset_plugins` drops it (tests). A plugin that fails
to import, fails pluggy's validation or raises in a hook is reported with its distribution, version and the
original exception, contributes nothing, and does not stop the others.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import pluggy

from . import hookspecs
from .errors import PluginError
from .registry import CheckpointMergerRegistry, EngineRegistry, PluginSource, RoleRegistry, RolloutRegistry

if TYPE_CHECKING:
    import click

DISABLE_ENV = "DRIVETRAIN_DISABLE_PLUGINS"
"""Comma-separated entry-point names that operators block from loading."""

PluginStatus = Literal["loaded", "failed", "blocked"]
REGISTRAR_HOOKS: tuple[str, ...] = (
    "register_engines",
    "register_roles",
    "register_checkpoint_mergers",
    "register_rollouts",
)


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
        status: ``loaded``, ``failed`` or ``blocked``.
        error: the original exception, formatted on one line (``None`` unless failed).
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


def _source_of(entry_point: EntryPointLike) -> PluginSource:
    dist = entry_point.dist
    if dist is None:
        return PluginSource(name=entry_point.name, distribution="<unknown distribution>", version="")
    return PluginSource(name=entry_point.name, distribution=dist.name, version=dist.version)


def _info(source: PluginSource, status: PluginStatus, error: str | None = None) -> PluginInfo:
    return PluginInfo(
        name=source.name, distribution=source.distribution, version=source.version, status=status, error=error
    )


def _format_exception(error: BaseException) -> tuple[str, str]:
    summary = "".join(traceback.format_exception_only(type(error), error)).strip()
    return summary, "".join(traceback.format_exception(error))


def _call(impl: pluggy.HookImpl, **arguments: Any) -> None:
    """Call one plugin's hook implementation alone, so its failure can be attributed and isolated."""
    impl.function(*(arguments[name] for name in impl.argnames))


def disabled_from_env() -> set[str]:
    """Entry-point names listed in ``DRIVETRAIN_DISABLE_PLUGINS`` (empty names ignored)."""
    return {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}


class DrivetrainPlugins:
    """A loaded set of plugins and the registries they filled.

    Built by :func:`get_plugin_manager`; exposes ``engines``, ``roles``, ``mergers``, ``rollouts``, ``plugins`` and
    :meth:`register_commands`.
    """

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.engines = EngineRegistry()
        self.roles = RoleRegistry()
        self.mergers = CheckpointMergerRegistry()
        self.rollouts = RolloutRegistry()
        self._infos: dict[str, PluginInfo] = {}
        self._commands: dict[str, list[str]] = {}

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every discovered plugin in discovery order, with what it registered."""
        return [self._with_registered(key, info) for key, info in self._infos.items()]

    def load(self, entry_points: Iterable[EntryPointLike], disabled: set[str]) -> None:
        """Load and validate each entry point, then call the registrar hooks; failures are recorded."""
        for entry_point in entry_points:
            self._load_one(entry_point, disabled)
        self.manager.check_pending()
        for hook_name in REGISTRAR_HOOKS:
            self._call_registrar_hook(hook_name)
        for info in self._infos.values():
            for registry in self._registries():
                if info.status == "failed":
                    registry.note_failed_plugin(
                        f"{info.name} ({info.distribution} {info.version}): {info.error}"
                    )
                elif info.status == "blocked":
                    registry.note_blocked_plugin(self._source(info.name))

    def problems(self) -> list[str]:
        """What a command reports on stderr before it runs: failed plugins and keys several plugins claim."""
        failed = [
            f"plugin {info.name!r} ({info.distribution} {info.version}) failed to load: {info.error}"
            for info in self._infos.values()
            if info.status == "failed"
        ]
        return failed + [line for registry in self._registries() for line in registry.conflicts()]

    def register_commands(self, cli: click.Group) -> list[PluginInfo]:
        """Let every loaded plugin add sub-commands to ``cli``.

        A plugin whose hook raises keeps its engines but is marked failed, and the commands it added
        before failing are removed, so the CLI never offers a half-registered command.

        Returns:
            The plugins whose command registration failed (the CLI reports them on stderr).
        """
        failures = []
        for impl in self.manager.hook.register_commands.get_hookimpls():
            before = set(cli.commands)
            try:
                _call(impl, cli=cli)
            except Exception as e:
                for name in set(cli.commands) - before:
                    del cli.commands[name]
                failures.append(self._fail(impl.plugin_name, e, hook="register_commands"))
                continue
            self._commands[impl.plugin_name] = sorted(set(cli.commands) - before)
        return [self._with_registered(info.name, info) for info in failures]

    def _registries(
        self,
    ) -> tuple[EngineRegistry, RoleRegistry, CheckpointMergerRegistry, RolloutRegistry]:
        return self.engines, self.roles, self.mergers, self.rollouts

    def _load_one(self, entry_point: EntryPointLike, disabled: set[str]) -> None:
        source = _source_of(entry_point)
        if entry_point.name in self._infos:
            first = self._infos[entry_point.name]
            error = (
                f"plugin name {entry_point.name!r} is declared by both {first.distribution} {first.version} and "
                f"{source.describe()}; uninstall one of them."
            )
            self._infos[f"{entry_point.name}#{len(self._infos)}"] = _info(source, "failed", error)
            return
        if entry_point.name in disabled:
            self.manager.set_blocked(entry_point.name)
            self._infos[entry_point.name] = _info(source, "blocked")
            return
        self._infos[entry_point.name] = _info(source, "loaded")
        try:
            self.manager.register(entry_point.load(), name=entry_point.name)
            # Checked per plugin so that an unknown hook name is blamed on the plugin that declared it.
            self.manager.check_pending()
        except Exception as e:
            self._fail(entry_point.name, e)

    def _call_registrar_hook(self, hook_name: str) -> None:
        hook = getattr(self.manager.hook, hook_name)
        registry = dict(zip(REGISTRAR_HOOKS, self._registries(), strict=True))[hook_name]
        for impl in hook.get_hookimpls():
            source = self._source(impl.plugin_name)
            try:
                with registry.registering_as(source):
                    _call(impl, registry=registry)
            except Exception as e:
                self._fail(impl.plugin_name, e, hook=hook_name)

    def _source(self, plugin_name: str) -> PluginSource:
        info = self._infos[plugin_name]
        return PluginSource(name=info.name, distribution=info.distribution, version=info.version)

    def _fail(self, plugin_name: str, error: Exception, hook: str | None = None) -> PluginInfo:
        """Record a failure and withdraw the plugin from the registries (not from the CLI's engines)."""
        summary, full = _format_exception(error)
        self._infos[plugin_name] = dataclasses.replace(
            self._infos[plugin_name],
            status="failed",
            error=f"{hook}: {summary}" if hook else summary,
            traceback=full,
        )
        if hook != "register_commands":
            for registry in self._registries():
                registry.remove_source(plugin_name)
            if self.manager.has_plugin(plugin_name):
                self.manager.unregister(name=plugin_name)
        return self._infos[plugin_name]

    def _with_registered(self, key: str, info: PluginInfo) -> PluginInfo:
        lines = [line for registry in self._registries() for line in registry.registered_by(key)]
        lines += [f"command {name}" for name in self._commands.get(key, [])]
        return dataclasses.replace(info, registered=lines)


def get_plugin_manager(
    *,
    entry_points: Iterable[EntryPointLike] | None = None,
    disabled: Iterable[str] | None = None,
) -> DrivetrainPlugins:
    """Discover and load plugins into a fresh :class:`DrivetrainPlugins`.

    Args:
        entry_points: entry points to load; default: every installed entry point of group ``drivetrain``.
        disabled: entry-point names to block; default: ``DRIVETRAIN_DISABLE_PLUGINS``.

    Returns:
        The loaded plugins with their registries filled; failures are recorded, never raised.
    """
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME)
    blocked = disabled_from_env() if disabled is None else set(disabled)
    result = DrivetrainPlugins()
    result.load(sorted(entry_points, key=lambda ep: ep.name), blocked)
    return result


_cache_lock = threading.RLock()  # re-entrant so that a hook calling plugins() gets an error, not a hang
_cached: DrivetrainPlugins | None = None
_loading = False


def plugins(factory: Callable[[], DrivetrainPlugins] = get_plugin_manager) -> DrivetrainPlugins:
    """The process-wide plugins, loaded on first call (by ``factory``) and cached.

    Raises:
        PluginError: called from a plugin hook while the plugins are still loading.
    """
    global _cached, _loading
    with _cache_lock:
        if _cached is None:
            if _loading:
                raise PluginError(
                    "plugins() was called from a plugin hook while plugins are loading; use the registrar the "
                    "hook receives, and look other plugins up later (in the command or engine code)."
                )
            _loading = True
            try:
                _cached = factory()
            finally:
                _loading = False
        return _cached


def reset_plugins() -> None:
    """Forget the cached plugins, so the next :func:`plugins` call discovers them again (tests)."""
    global _cached
    with _cache_lock:
        _cached = None


__all__ = [
    "DISABLE_ENV",
    "DrivetrainPlugins",
    "EntryPointLike",
    "PluginInfo",
    "disabled_from_env",
    "get_plugin_manager",
    "plugins",
    "reset_plugins",
]
