"""The click options every config-driven command shares: ``--config``, ``--print-config``, ``--help-config``.

``@config_options(SFTConfig)`` adds them and the ``OVERRIDES`` argument; the command receives
``config_file`` and ``overrides``. ``--print-config`` prints the resolved config as YAML (loadable again with
``--config``; a comment names the preset, ``--config`` or ``command line`` beside each value they set) and ``--help-config`` lists every field with its type, default and help; both exit without
running the command.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import click

from .load import load_config, load_sources
from .render import describe_fields, format_reference, to_yaml


def config_options(config_cls: type | str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a click command function with the config options of ``config_cls``.

    Args:
        config_cls: the command's config dataclass, or its ``"module:attr"`` path, imported only when
            ``--print-config`` / ``--help-config`` is given (so registering the command stays cheap).
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def run(*, print_config: bool, help_config: bool, **kwargs: Any) -> Any:
            if print_config or help_config:
                cls, given = resolve_target(config_cls), (kwargs["config_file"], kwargs["overrides"])
                config: Any = load_config(cls, *given)
                shown = to_yaml(config, load_sources(cls, *given)) if print_config else None
                click.echo(shown or format_reference(describe_fields(config)))
                return None
            return command(**kwargs)

        for option in reversed(_OPTIONS):
            run = option(run)
        return run

    return decorate


def resolve_target(target: type | str) -> type:
    """``target`` itself, or the class its ``"module:attr"`` path names (imported now)."""
    if isinstance(target, type):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


_OPTIONS = (
    click.option(
        "--config", "config_file", type=click.Path(dir_okay=False), help="YAML file of config sections."
    ),
    click.option(
        "--print-config",
        is_flag=True,
        help="Print the resolved config (defaults, presets, --config, overrides) as YAML, each value's source "
        "in a comment, and exit.",
    ),
    click.option(
        "--help-config",
        is_flag=True,
        help="List every config field with its type, default and help, and exit.",
    ),
    click.argument("overrides", nargs=-1),
)


__all__ = ["config_options"]
