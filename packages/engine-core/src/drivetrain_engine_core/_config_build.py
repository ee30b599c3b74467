"""Typed config dataclasses from plain values (as read from YAML), checked without a config library.

:func:`~.config.config_from_dict` and ``engine_config_from_dict`` build an engine's or a model's config here,
so a backend author's install needs no config stack. The commands' layered config (a YAML file plus dotted
overrides, merged by OmegaConf) lives in drivetrain-roles and shares :func:`check_keys`,
:func:`exclusive_limits` and the messages of :mod:`.config_fields`, so both say the same about the same mistake.

Values are accepted as OmegaConf accepts them: ``int`` for a ``float``, a numeric string for a number
(YAML 1.1 reads ``5e-3`` as a string), ``yes``/``no``/``1``/``0`` for a ``bool``, a list for a tuple, a
mapping for a nested dataclass.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ._config_fields import field_types, how_to_write, nested_dataclass, type_name
from ._errors import ConfigError

ConfigT = TypeVar("ConfigT")

_TRUE = frozenset({"true", "yes", "on", "y", "1"})
_FALSE = frozenset({"false", "no", "off", "n", "0"})


class _Mismatch(Exception):
    """A value does not fit an annotation; turned into one :class:`ConfigError` naming the whole field."""


def build_dataclass(cls: type[ConfigT], values: Mapping[str, Any], *, where: str) -> ConfigT:
    """The dataclass ``cls`` from ``values`` over its defaults, every key and value checked.

    Args:
        cls: a frozen config dataclass; fields typed as dataclasses are built from nested mappings.
        values: plain values; keys ``cls`` does not declare are refused.
        where: the dotted prefix that names ``cls``'s fields in messages (``engine``, ``ModelConfig``).

    Raises:
        ConfigError: an unknown key (with the close match), a missing required field, a value that does not
            fit its annotation, or one that fails the dataclass's own ``__post_init__`` checks.
    """
    plain = exclusive_limits(dict(values), cls)
    check_keys(plain, cls, where, {})
    try:
        return _instance(cls, plain, where)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from e


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


def _instance(cls: type[ConfigT], values: Mapping[str, Any], where: str) -> ConfigT:
    types_ = field_types(cls)
    given = {name: _field_value(value, types_[name], _join(where, name)) for name, value in values.items()}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.init and required and f.name not in given:
            raise ConfigError(f"{_join(where, f.name)} is required and has no default; set it.")
    return cls(**given)


def _field_value(value: Any, annotation: Any, name: str) -> Any:
    try:
        return _convert(value, annotation, name)
    except _Mismatch:
        raise ConfigError(
            f"{name}={value!r} is not a valid {type_name(annotation)}; {how_to_write(annotation, name)}"
        ) from None


def _convert(value: Any, annotation: Any, name: str) -> Any:
    """``value`` as ``annotation`` says, or :class:`_Mismatch`; nested dataclasses are built (and checked)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, args, name)
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Mismatch
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, Mapping):
            return _instance(annotation, value, name)
        raise _Mismatch
    if origin in (tuple, list):
        return _sequence(value, origin, args, name)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch
        return {k: _convert(v, args[1] if args else Any, name) for k, v in value.items()}
    return _scalar(value, annotation)


def _union(value: Any, args: tuple[Any, ...], name: str) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise _Mismatch
    for arm in args:
        if arm is type(None):
            continue
        try:
            return _convert(value, arm, name)
        except _Mismatch:
            continue
    raise _Mismatch


def _sequence(value: Any, origin: type, args: tuple[Any, ...], name: str) -> Any:
    if not isinstance(value, list | tuple):
        raise _Mismatch
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise _Mismatch
        return tuple(_convert(v, a, name) for v, a in zip(value, args, strict=True))
    items = [_convert(v, args[0] if args else Any, name) for v in value]
    return tuple(items) if origin is tuple else items


def _scalar(value: Any, annotation: Any) -> Any:
    """A bool, int, float or str as OmegaConf would accept it; any other class by ``isinstance``."""
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int | str) and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise _Mismatch
    if annotation in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise _Mismatch
        if annotation is int and isinstance(value, float):
            raise _Mismatch
        try:
            return annotation(value)
        except ValueError:
            raise _Mismatch from None
    if annotation is str:
        if isinstance(value, str | int | float):
            return str(value)
        raise _Mismatch
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise _Mismatch
    return value


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


__all__ = ["build_dataclass", "check_keys", "exclusive_limits"]
