"""Plugin discovery: load the ``drivetrain`` entry points (:mod:`.plugin_loading`), call their hooks, fill the
registrars.

:func:`get_plugin_manager` builds a fresh :class:`DrivetrainPlugins` (never at import); :func:`plugins` caches
one per process for library code and the CLI, and :func:`reset_plugins` drops it (tests). A plugin that fails
to import, fails pluggy's validation or raises in a hook is reported with its distribution, version and the
original exception, contributes nothing, and does not stop the others.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from . import _hookspecs as hookspecs
from ._errors import PluginError
from ._plugin_loading import (
    DISABLE_ENV,
    EntryPointLike,
    PluginInfo,
    disabled_from_env,
    failed,
    load_entry_point,
    problem_line,
)
from ._registry import (
    CheckpointMergerRegistry,
    EngineRegistry,
    EnvironmentRegistry,
    PluginSource,
    RoleRegistry,
    RolloutRegistry,
)

if TYPE_CHECKING:
    import click

REGISTRAR_HOOKS: tuple[str, ...] = (
    "register_engines",
    "register_roles",
    "register_checkpoint_mergers",
    "register_rollouts",
    "register_environments",
)


logger = logging.getLogger(__name__)


class DrivetrainPlugins:
    """A loaded set of plugins and the registries they filled.

    Built by :func:`get_plugin_manager`; exposes ``engines``, ``roles``, ``mergers``, ``rollouts``, ``environments``, ``plugins`` and
    :meth:`register_commands`.
    """

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.engines = EngineRegistry()
        self.roles = RoleRegistry()
        self.mergers = CheckpointMergerRegistry()
        self.rollouts = RolloutRegistry()
        self.environments = EnvironmentRegistry()
        self._infos: dict[str, PluginInfo] = {}
        self._commands: dict[str, list[str]] = {}
        self._command_conflicts: dict[str, list[str]] = {}
        self._command_refusals: list[str] = []

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
                if info.status in ("failed", "incompatible"):
                    registry.note_failed_plugin(
                        f"{info.name} ({info.distribution} {info.version}): {info.error}"
                    )
                elif info.status == "blocked":
                    registry.note_blocked_plugin(self._source(info.name))

    def problems(self) -> list[str]:
        """What a command reports on stderr before it runs: failed and incompatible plugins, keys several claim."""
        plugin_lines = [problem_line(info) for info in self._infos.values()]
        conflicts = [line for registry in self._registries() for line in registry.conflicts()]
        return [line for line in plugin_lines if line is not None] + conflicts

    def register_commands(self, cli: click.Group) -> list[PluginInfo]:
        """Let every loaded plugin add sub-commands to ``cli``.

        A plugin whose hook raises keeps its engines but is marked failed, and the commands it added
        before failing are removed, so the CLI never offers a half-registered command. Commands follow the
        registries' rule, no precedence: a command name two plugins add is a conflict and neither is offered,
        and drivetrain's own commands (``engines``, ``plugins``, ``env``) cannot be replaced
        (:meth:`command_problems` says so).

        Returns:
            The plugins whose command registration failed (the CLI reports them on stderr).
        """
        # Per CLI: the process-wide plugins serve every CLI built in the process (tests build one per call).
        self._commands, self._command_conflicts, self._command_refusals = {}, {}, []
        failures = []
        for plugin_name in self._implementers("register_commands"):
            before = dict(cli.commands)
            try:
                self._call_one("register_commands", plugin_name, cli=cli)
            except Exception as e:
                cli.commands.clear()
                cli.commands.update(before)
                failures.append(self._fail(plugin_name, e, hook="register_commands"))
                continue
            self._commands[plugin_name] = self._settle_commands(plugin_name, before, cli)
        return [self._with_registered(info.name, info) for info in failures]

    def command_problems(self) -> list[str]:
        """Commands no plugin got: drivetrain's own that a plugin tried to replace, and names several claimed."""
        conflicts = [
            f"command {name!r} is added by several plugins: "
            f"{', '.join(f'{p!r} ({self._source(p).describe()})' for p in claimants)}. There is no precedence, so "
            f"neither is offered: uninstall one, or block one with {DISABLE_ENV}=<name>."
            for name, claimants in sorted(self._command_conflicts.items())
        ]
        return self._command_refusals + conflicts

    def _settle_commands(
        self, plugin_name: str, before: dict[str, click.Command], cli: click.Group
    ) -> list[str]:
        """The commands ``plugin_name``'s hook added; ``add_command`` overwrites silently, so a command it replaced
        is put back (drivetrain's own) or withdrawn as a conflict (another plugin's)."""
        owners = {name: owner for owner, names in self._commands.items() for name in names}
        added = []
        for name, command in list(cli.commands.items()):
            if before.get(name) is command:
                continue
            if name in self._command_conflicts:
                del cli.commands[name]
                self._command_conflicts[name].append(plugin_name)
            elif name in owners:
                del cli.commands[name]
                self._commands[owners[name]].remove(name)
                self._command_conflicts[name] = [owners[name], plugin_name]
            elif name in before:
                cli.commands[name] = before[name]
                self._command_refusals.append(
                    f"plugin {plugin_name!r} ({self._source(plugin_name).describe()}) may not replace drivetrain's "
                    f"own command {name!r}; drivetrain's is kept. Give the plugin's command a name of its own."
                )
            else:
                added.append(name)
        return sorted(added)

    def _registries(
        self,
    ) -> tuple[EngineRegistry, RoleRegistry, CheckpointMergerRegistry, RolloutRegistry, EnvironmentRegistry]:
        return self.engines, self.roles, self.mergers, self.rollouts, self.environments

    def _load_one(self, entry_point: EntryPointLike, disabled: set[str]) -> None:
        error = load_entry_point(self.manager, self._infos, entry_point, disabled)
        if error is not None:
            self._fail(entry_point.name, error)

    def _implementers(self, hook_name: str) -> list[str]:
        """Plugins implementing ``hook_name``, each once (a plugin may add wrappers), in registration order."""
        names = [impl.plugin_name for impl in getattr(self.manager.hook, hook_name).get_hookimpls()]
        return list(dict.fromkeys(names))

    def _call_one(self, hook_name: str, plugin_name: str, **arguments: Any) -> None:
        """Call one plugin's implementations of ``hook_name`` alone, so a failure is attributed and isolated.

        NOTE: through pluggy's own hook execution (``PluginManager._hookexec``, what a hook call runs), so hook
        tracing, call monitoring and the plugin's own wrappers keep working; only the other plugins'
        implementations (and wrappers) are left out. ``subset_hook_caller`` would do the same but needs
        hashable plugin objects.
        """
        hook = getattr(self.manager.hook, hook_name)
        impls = [impl for impl in hook.get_hookimpls() if impl.plugin_name == plugin_name]
        self.manager._hookexec(hook_name, impls, arguments, False)

    def _call_registrar_hook(self, hook_name: str) -> None:
        registry = dict(zip(REGISTRAR_HOOKS, self._registries(), strict=True))[hook_name]
        for plugin_name in self._implementers(hook_name):
            source = self._source(plugin_name)
            try:
                with registry.registering_as(source):
                    self._call_one(hook_name, plugin_name, registry=registry)
            except Exception as e:
                self._fail(plugin_name, e, hook=hook_name)

    def _source(self, plugin_name: str) -> PluginSource:
        info = self._infos[plugin_name]
        return PluginSource(name=info.name, distribution=info.distribution, version=info.version)

    def _fail(self, plugin_name: str, error: Exception, hook: str | None = None) -> PluginInfo:
        """Record a failure and withdraw the plugin from the registries (not from the CLI's engines)."""
        self._infos[plugin_name] = failed(self._infos[plugin_name], error, hook)
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
    ordered = sorted(entry_points, key=lambda ep: ep.name)
    _warn_unknown_blocked(blocked, [ep.name for ep in ordered])
    result = DrivetrainPlugins()
    result.load(ordered, blocked)
    return result


def _warn_unknown_blocked(blocked: set[str], names: list[str]) -> None:
    """Warn about blocked names no plugin has: a typo (``role`` for ``roles``) blocked nothing, silently."""
    unknown = sorted(blocked - set(names))
    if unknown:
        logger.warning(
            "%s names %s, which no installed plugin is called; the plugins are %s. Fix the name to block one.",
            DISABLE_ENV,
            unknown,
            sorted(set(names)),
        )


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
