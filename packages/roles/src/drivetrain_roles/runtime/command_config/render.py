"""A resolved config as users read it: plain values, YAML, and the field reference of ``--help-config``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from drivetrain_engine_core.job import field_docs, field_types, nested_dataclass, type_name


def to_plain(config: Any) -> dict[str, Any]:
    """The resolved config as plain dicts, lists and scalars (what ``config.yaml`` and ``summary.json`` hold)."""
    from omegaconf import OmegaConf

    return _lists(OmegaConf.to_container(OmegaConf.structured(config)))


def _lists(value: Any) -> Any:
    """Tuples as lists, recursively, so the values are JSON and safe-YAML as they are."""
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(item) for item in value]
    return value


def to_yaml(config: Any, sources: Mapping[str, str] | None = None) -> str:
    """The resolved config as YAML, loadable again with ``--config`` (sections in declaration order).

    Args:
        config: the resolved config.
        sources: where values come from by dotted key (``preset user-model``, ``--config``): each is named in
            a comment at the end of its line (``--print-config``); the command's own defaults have none.
    """
    import yaml

    if not sources:
        return yaml.safe_dump(to_plain(config), sort_keys=False)
    text = yaml.safe_dump(to_plain(config), sort_keys=False, width=float("inf"))
    return "".join(_with_source(line, sources) for line in _keyed_lines(text))


def _keyed_lines(text: str) -> list[tuple[str, str]]:
    """``(dotted key, line)`` of each line of block YAML (``""`` for a line that starts no key: list items)."""
    keyed: list[tuple[str, str]] = []
    path: list[str] = []
    for line in text.splitlines(keepends=True):
        match = _KEY.match(line)
        if match is None:
            keyed.append(("", line))
            continue
        depth = len(match["indent"]) // 2
        path = [*path[:depth], match["key"]]
        keyed.append((".".join(path), line))
    return keyed


def _with_source(keyed: tuple[str, str], sources: Mapping[str, str]) -> str:
    key, line = keyed
    source = sources.get(key)
    return f"{line.rstrip(chr(10))}  # {source}\n" if source else line


_KEY = re.compile(r"^(?P<indent>(?:  )*)(?P<key>[A-Za-z_][\w]*):(?: |$)")


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One leaf field of a config: its dotted name, type, default and help."""

    name: str
    type: str
    default: Any
    help: str


def describe_fields(config: Any, prefix: str = "") -> list[FieldInfo]:
    """Every leaf field of a config instance (defaults are its values), sections first to last."""
    docs, types = field_docs(type(config)), field_types(type(config))
    infos = []
    for f in dataclasses.fields(config):
        name, value = f"{prefix}{f.name}", getattr(config, f.name)
        nested = nested_dataclass(types[f.name])
        if dataclasses.is_dataclass(value):
            infos.extend(describe_fields(value, f"{name}."))
        elif nested is not None and value is None:
            infos.append(FieldInfo(name, type_name(types[f.name]), None, docs.get(f.name, "")))
            infos.extend(describe_fields(_defaults_of(nested), f"{name}."))
        else:
            infos.append(FieldInfo(name, type_name(types[f.name]), value, docs.get(f.name, "")))
    return infos


def _defaults_of(cls: type) -> Any:
    """``cls`` built from its defaults, or ``None`` when a field has none (then it is listed without defaults)."""
    try:
        return cls()
    except TypeError:
        return None


def format_reference(fields: list[FieldInfo]) -> str:
    """The ``--help-config`` text: one block per field, ``name: type = default`` then its help."""
    lines = []
    for info in fields:
        lines.append(f"{info.name}: {info.type} = {_yaml_scalar(info.default)}")
        if info.help:
            lines.append(f"    {info.help}")
    return "\n".join(lines)


def _yaml_scalar(value: Any) -> str:
    import yaml

    shown = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(shown, default_flow_style=True).strip().removesuffix("...").strip()


__all__ = ["FieldInfo", "describe_fields", "format_reference", "to_plain", "to_yaml"]
