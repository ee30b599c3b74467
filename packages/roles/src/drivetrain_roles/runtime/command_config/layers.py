"""The user's layers of a command config: a YAML file and ``dotted.key=value`` overrides, as plain mappings.

Values are parsed as YAML (``512``, ``true``, ``null``, ``[a, b]``); ``5e-3``, which YAML 1.1 reads as a
string, is read as the number users mean. Types are checked later, against the dataclasses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import lookup


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping of sections in a YAML config file.

    Raises:
        ConfigError: the file is missing, is not valid YAML, or does not hold a mapping.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config.")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model, engine, ...).")
    return loaded


def parse_override(override: str) -> dict[str, Any]:
    """``a.b.c=value`` as the nested mapping ``{"a": {"b": {"c": value}}}``.

    Raises:
        ConfigError: the override has no ``=``, an empty key part, or a value that is not valid YAML.
    """
    import yaml

    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(
            f"override {override!r} must look like section.key=value, e.g. trainer.total_steps=100."
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({e}).") from e
    nested: Any = _number_or_value(value)
    for part in reversed(parts):
        nested = {part: nested}
    return nested


def _number_or_value(value: Any) -> Any:
    """YAML 1.1 reads ``5e-3`` as a string (it wants ``5.0e-3``); users mean the number. ``None`` (Python's
    spelling, what the fields' help says and TRL users type) is YAML's ``null``."""
    if value == "None":
        return None
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


__all__ = ["lookup", "parse_override", "read_yaml"]  # lookup: core's, where every builder reads it
