"""A command's config from its layers: the dataclass defaults, its presets, a YAML file, dotted overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from .build import build_config, value_sources
from .layers import parse_override, read_yaml

ConfigT = TypeVar("ConfigT")


def load_config(
    cls: type[ConfigT], config_file: str | Path | None = None, overrides: Sequence[str] = ()
) -> ConfigT:
    """``cls``'s defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), fully checked.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown section or key, or an invalid value.
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    layers = [read_yaml(config_file)] if config_file else []
    return build_config(cls, [*layers, *(parse_override(o) for o in overrides)], file_layers=len(layers))


def load_sources(
    cls: type, config_file: str | Path | None = None, overrides: Sequence[str] = ()
) -> dict[str, str]:
    """Where each value of :func:`load_config`'s result that is not ``cls``'s own default comes from, by dotted
    key: ``preset <name>``, ``--config`` or ``command line``."""
    layers = [read_yaml(config_file)] if config_file else []
    return value_sources(cls, [*layers, *(parse_override(o) for o in overrides)], file_layers=len(layers))


__all__ = ["load_config", "load_sources"]
