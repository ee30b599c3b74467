"""Typed config dataclasses from layers of plain values (as read from YAML): drivetrain's one config builder.

Built on OmegaConf structured configs (what Hydra and verl users write): OmegaConf merges the layers onto the
dataclass's defaults and checks every value against its annotation (``int`` for a ``float``, a numeric string
for a number, ``yes``/``no`` for a ``bool``, a list for a tuple, a mapping for a nested dataclass). drivetrain
adds the unknown-key check with the close match, exclusive limits, and messages that name the field and the fix.

:func:`~.config.config_from_dict`, ``engine_config_from_dict``, a rollout's options and every command's layered
config (drivetrain-roles' ``command_config``) are built here. OmegaConf is imported when a config is built,
never when core's backend surface is imported.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ._config_fields import field_types, how_to_write, nested_dataclass, type_name
from ._errors import ConfigError

ConfigT = TypeVar("ConfigT")


def build_dataclass(cls: type[ConfigT], values: Mapping[str, Any], *, where: str) -> ConfigT:
    """The dataclass ``cls`` from ``values`` over its defaults, every key and value checked (one layer of
    :func:`build_layers`)."""
    return build_layers(cls, [values], where=where)


def build_layers(
    cls: type[ConfigT],
    layers: Sequence[Mapping[str, Any]],
    *,
    where: str = "",
    sections: Mapping[str, type] | None = None,
    sources: Sequence[str | None] = (),
) -> ConfigT:
    """The dataclass ``cls`` from its defaults and ``layers`` (later layers win), every key and value checked.

    Args:
        cls: a frozen config dataclass; fields typed as dataclasses are built from nested mappings.
        layers: plain nested mappings; keys ``cls`` does not declare are refused.
        where: the dotted prefix that names ``cls``'s fields in messages (``engine``, ``ModelConfig``).
        sections: a dotted section name -> the config class that replaces its declared type there (a
            command's ``engine`` section is typed by the backend it names).
        sources: per layer, how messages name it ("the config file"); unnamed past its end.

    Raises:
        ConfigError: an unknown key (with the close match), a missing required field, a value that does not
            fit its annotation, or one that fails the dataclass's own ``__post_init__`` checks.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    sections = dict(sections or {})
    plain = [exclusive_limits(dict(layer), cls) for layer in layers]
    for index, layer in enumerate(plain):
        check_keys(layer, cls, where, sections, source=sources[index] if index < len(sources) else None)
    schema = _schema(cls, sections)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, *plain))  # type: ignore[return-value]
    except MissingMandatoryValue as e:
        name = _join(where, str(e.full_key))
        raise ConfigError(f"{name} is required and has no default; set it.") from e
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "") or _failing_key(schema, plain)
        raise _field_error(e, key, cls, plain, where, sections) from e
    except TypeError as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def check_keys(
    values: Mapping[str, Any],
    cls: type,
    where: str,
    backends: Mapping[str, type],
    *,
    source: str | None = None,
) -> None:
    """Every key of ``values`` is a field of ``cls`` (recursively) and every section a mapping; else one error
    with the close match, or with the value given (by ``source``, when named: "the config file").

    ``backends`` maps a dotted section name to the config class that replaces its declared type there (a
    command's ``engine`` section is typed by the backend it names).

    NOTE: a command checks each layer on its own: once merged, a section the file wrote as ``trainer: 5`` was
    reported with the value an override gave (``trainer={'total_steps': 3}``), not the one to fix in the file.
    """
    types_ = field_types(cls)
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in types_:
            close = difflib.get_close_matches(key, list(types_), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown option {path}; known options: {sorted(types_)}.{hint}")
        nested = backends.get(path) or nested_dataclass(types_[key])
        if nested is None or isinstance(value, nested):  # a section given built (a typed caller) is checked
            continue
        if not isinstance(value, Mapping) and value is not None:
            given = f"{source} gives it" if source else "it is given"
            raise ConfigError(
                f"{path} is a section of options, but {given} the value {value!r}; write its options under it "
                f"(in YAML `{path.split('.')[-1]}:` then one indented `option: value` per line, or "
                f"{path}.<option>=<value> on the command line)."
            )
        if isinstance(value, Mapping):
            check_keys(value, nested, path, backends, source=source)


def exclusive_limits(layer: dict[str, Any], cls: type) -> dict[str, Any]:
    """A layer that sets one of a dataclass's ``exclusive_fields`` clears the others (e.g. micro-batch limits)."""
    types_ = field_types(cls)
    exclusive = getattr(cls, "exclusive_fields", ())
    chosen = [k for k in exclusive if layer.get(k) is not None]
    if len(chosen) == 1:
        layer = {**{k: None for k in exclusive}, **layer}
    for key, value in list(layer.items()):
        nested = nested_dataclass(types_.get(key))
        if nested is not None and isinstance(value, Mapping):
            layer[key] = exclusive_limits(dict(value), nested)
    return layer


def lookup(layers: Sequence[Mapping[str, Any]], path: Sequence[str]) -> tuple[bool, Any]:
    """Whether any layer sets the dotted ``path`` (its parts), and the value of the last one that does."""
    found, value = False, None
    for layer in layers:
        node: Any = layer
        for part in path:
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            found, value = True, node
    return found, value


def _schema(cls: type, sections: Mapping[str, type]) -> Any:
    """``cls``'s defaults as a typed OmegaConf node, each of ``sections`` typed by its own class."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(cls)
    for name, section_cls in sections.items():
        schema = OmegaConf.merge(schema, _nested(name, OmegaConf.structured(section_cls)))
    return schema


_INDEX = re.compile(r"\[\d+\]")


def _failing_key(schema: Any, layers: Sequence[Mapping[str, Any]]) -> str:
    """The dotted key of the first given value the schema refuses on its own, or ``""``.

    NOTE: OmegaConf names no key for some refusals (a tuple of the wrong length: "TupleConfig length 1 does not
    match type hint length 2"), so each value is merged alone to find the one to name.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for layer in layers:
        for key, value in leaves(layer):
            try:
                OmegaConf.merge(schema, _nested(key, value))
            except OmegaConfBaseException:
                return key
    return ""


def leaves(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-mapping value (a list is a value)."""
    found: list[tuple[str, Any]] = []
    for name, value in values.items():
        key = f"{prefix}{name}"
        found += leaves(value, f"{key}.") if isinstance(value, Mapping) else [(key, value)]
    return found


def _nested(key: str, value: Any) -> Any:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _field_error(
    error: Exception,
    key: str,
    cls: type,
    layers: Sequence[Mapping[str, Any]],
    where: str,
    sections: Mapping[str, type],
) -> ConfigError:
    """One line naming the field (``key``), the value given, the type it needs and how to write one."""
    path = tuple(_INDEX.sub("", key).split(".")) if key else ()
    annotation = _annotation_at(cls, path, sections)
    given, value = lookup(layers, path)
    name = _join(where, key)
    if annotation is None or not given:
        message = (getattr(error, "msg", None) or str(error)).split("\n")[0]
        return ConfigError(f"{name or cls.__name__}: {message}")
    return ConfigError(
        f"{name}={value!r} is not a valid {type_name(annotation)}; {how_to_write(annotation, name)}"
    )


def _annotation_at(cls: type, path: tuple[str, ...], sections: Mapping[str, type]) -> Any:
    owner: type | None = cls
    annotation: Any = None
    for depth, part in enumerate(path):
        if owner is None:
            return None
        annotation = field_types(owner).get(part)
        if annotation is None:
            return None
        owner = sections.get(".".join(path[: depth + 1])) or nested_dataclass(annotation)
    return annotation


def _join(where: str, name: str) -> str:
    return ".".join(p for p in (where, name) if p)


__all__ = ["build_dataclass", "build_layers", "check_keys", "exclusive_limits", "leaves", "lookup"]
