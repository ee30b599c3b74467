"""Every hook a drivetrain plugin can implement, in one place.

A plugin is a small module named by an entry point of group ``drivetrain``; it decorates functions with
:data:`hookimpl` and imports nothing heavy, so that listing plugins stays cheap. Each hook receives a typed
registrar object rather than returning lists, so hooks can only ever gain arguments without breaking a plugin.

Example plugin module::

    from drivetrain_engine_core._hookspecs import hookimpl

    @hookimpl
    def register_engines(registry):
        registry.register(model_type="language_model", backend="mine", devices=["*"],
                          engine="my_pkg.engine:MyEngine", config="my_pkg.config:MyEngineConfig")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import click

    from ._registry import (
        CheckpointMergerRegistry,
        EngineRegistry,
        EnvironmentRegistry,
        RoleRegistry,
        RolloutRegistry,
    )

PROJECT_NAME = "drivetrain"
"""The pluggy project name and the entry-point group that plugins are discovered under."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_engines(registry: EngineRegistry) -> None:
    """Register engine backends; called once per plugin manager, right after every plugin is loaded.

    Args:
        registry: call ``registry.register(model_type=..., backend=..., devices=[...], engine=..., config=...)``
            once per (model_type, backend) pair. ``engine``/``config`` may be ``"module:attr"`` strings,
            imported only when an engine of that kind is created.
    """


@hookspec
def register_roles(registry: RoleRegistry) -> None:
    """Register training roles (actor, critic, SFT, ...); called once per plugin manager after loading.

    Args:
        registry: call ``registry.register(name, role)``; ``role`` is a class or a ``"module:attr"`` string.
    """


@hookspec
def register_checkpoint_mergers(registry: CheckpointMergerRegistry) -> None:
    """Register checkpoint mergers (sharded step -> Hugging Face directory), once per plugin manager.

    Args:
        registry: call ``registry.register(backend, merger)``; ``merger`` is a class or a ``"module:attr"``
            string, for the backend whose checkpoints it reads.
    """


@hookspec
def register_rollouts(registry: RolloutRegistry) -> None:
    """Register rollout (generation) backends, once per plugin manager after loading.

    Args:
        registry: call ``registry.register(name, rollout)``; ``rollout`` is a subclass of
            :class:`drivetrain_engine_core.rollout.Rollout` or a ``"module:attr"`` string naming one, imported
            only when a rollout of that name is created.
    """


@hookspec
def register_environments(registry: EnvironmentRegistry) -> None:
    """Register environments that multi-turn rollouts act in, once per plugin manager after loading.

    Args:
        registry: call ``registry.register(name, environment)``; ``environment`` is a subclass of
            :class:`drivetrain_engine_core.job.Environment` or a ``"module:attr"`` string naming one,
            imported only when an environment of that name is created (one instance per episode).
    """


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add sub-commands to the ``drivetrain`` command line; called only when the CLI runs.

    Args:
        cli: the root ``click`` group; call ``cli.add_command(...)`` or use ``@cli.command()``. Import heavy
            modules inside the command function, not at registration.
    """


__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "register_checkpoint_mergers",
    "register_commands",
    "register_engines",
    "register_environments",
    "register_roles",
    "register_rollouts",
]
