"""Typed configs from plain layers, through OmegaConf structured configs, with errors that name the field.

A command's config is one frozen dataclass of sections (its field defaults are the command's defaults). It is
built in five visible steps: the typed schema (a section typed :class:`~..config.EngineConfig` becomes the
class of the backend it names), a check of every key against the dataclasses (unknown keys get the close
match), OmegaConf's merge of the layers onto the schema (every value checked against its annotation), the
derived values the command computes from the others (``derived_values``, and each engine section's ``device``:
:func:`~.machine.machine_device`; only where no layer set them), and the dataclasses themselves (their ``__post_init__``
checks ranges and combinations).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from drivetrain_engine_core.backend import ConfigError, EngineConfig
from drivetrain_engine_core.job import (
    check_keys,
    exclusive_limits,
    field_types,
    how_to_write,
    nested_dataclass,
    type_name,
)

from .foreign_names import check_foreign_names
from .layers import lookup
from .machine import machine_device

if TYPE_CHECKING:
    from drivetrain_engine_core.job import DrivetrainPlugins
    from omegaconf import DictConfig

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")
Derive = Callable[["DictConfig"], dict[str, Any]]
"""``derived_values(config) -> {section: {key: value}}``: values that follow others unless the user set them."""


def build_config(
    cls: type[ConfigT],
    layers: Sequence[Mapping[str, Any]],
    *,
    where: str = "",
    plugins: DrivetrainPlugins | None = None,
    file_layers: int = 0,
) -> ConfigT:
    """The dataclass ``cls`` from its defaults and ``layers`` (later layers win), fully checked.

    Args:
        cls: a dataclass of sections or of plain fields; a ``derived_values`` static method, when it has one,
            computes values that follow others (e.g. the learning rate from the model).
        layers: plain nested mappings (a YAML file, then each override).
        where: the dotted prefix that names ``cls``'s fields in messages (``engine``), empty for a command.
        plugins: where backend config classes are looked up; default: the process-wide plugins.
        file_layers: how many of the first ``layers`` are YAML files: errors say which layer gave a bad section,
            and a file written for another backend than the one chosen sheds the options it left at that
            backend's defaults (``_for_backend``).

    A value any layer sets is set, whatever it equals: a resolved config (``--print-config``, a run's
    ``config.yaml``) re-runs as it was. A value that must follow another through such a file is ``null`` in
    it and resolved by the command (the LR schedule's length: ``RunOptimizerConfig.for_run``).

    Raises:
        ConfigError: an unknown key (with the close match), a value that does not fit its annotation, or one
            that fails the dataclass's own checks; the message names the field and the fix.
        PluginError: an ``engine.backend`` that no installed plugin provides.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    plain = [exclusive_limits(dict(layer), cls) for layer in layers]
    backends = _backend_classes(cls, plain, plugins)
    plain = [
        _for_backend(layer, cls, backends, plugins) if index < file_layers else layer
        for index, layer in enumerate(plain)
    ]
    classes = {name: backend_cls for name, (_, backend_cls) in backends.items()}
    for index, layer in enumerate(plain):
        if not where:
            check_foreign_names(layer, cls)
        check_keys(layer, cls, where, classes, source="the config file" if index < file_layers else None)
    try:
        typed = OmegaConf.merge(_schema(cls, backends), *plain)
        derive: Derive | None = getattr(cls, "derived_values", None)
        if derive is not None or backends:
            # NOTE: built once as written first, so that a bad value is reported where the user wrote it and
            # not in a section whose value follows it.
            OmegaConf.to_object(typed)
            machine = {name: {"device": machine_device()} for name in backends}
            _warn_cpu_beside_a_gpu(plain, machine)
            derived = derive(typed) if derive is not None else {}  # type: ignore[arg-type]
            follow = [_unset_only(machine, plain), _unset_only(derived, plain)]
            typed = OmegaConf.merge(typed, *follow)
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = str(getattr(e, "full_key", "") or "") or _failing_key(_schema(cls, backends), plain)
        raise _field_error(e, key, cls, plain, where, classes) from e
    except TypeError as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def _schema(cls: type, backends: Mapping[str, tuple[str, type]]) -> DictConfig:
    """``cls``'s defaults as a typed OmegaConf node, each engine section typed by its backend's class.

    A backend class keeps the command's own engine defaults (those that differ from :class:`EngineConfig`'s).
    """
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(cls)
    base: dict[str, Any] = OmegaConf.to_container(OmegaConf.structured(EngineConfig))  # type: ignore[assignment]
    for name, (backend, backend_cls) in backends.items():
        defaults: dict[str, Any] = OmegaConf.to_container(schema[name])  # type: ignore[assignment]
        changed = {k: v for k, v in defaults.items() if k in base and v != base[k]}
        node = OmegaConf.merge(OmegaConf.structured(backend_cls), changed, {"backend": backend})
        schema = OmegaConf.merge(schema, {name: node})
    return schema  # type: ignore[return-value]


def _backend_classes(
    cls: type, layers: Sequence[Mapping[str, Any]], plugins: DrivetrainPlugins | None
) -> dict[str, tuple[str, type]]:
    """``{section: (backend, its config class)}`` for each section of ``cls`` typed as an engine config."""
    if issubclass(cls, EngineConfig):
        return {}
    from drivetrain_engine_core.job import plugins as default_plugins

    found = {}
    for name, annotation in field_types(cls).items():
        declared = nested_dataclass(annotation)
        if declared is None or not issubclass(declared, EngineConfig):
            continue
        given, backend = lookup(layers, (name, "backend"))
        if not given:
            backend = _default_backend(cls, name)
        found[name] = (str(backend), (plugins or default_plugins()).engines.config_class(str(backend)))
    return found


def _for_backend(
    layer: dict[str, Any],
    cls: type,
    backends: Mapping[str, tuple[str, type]],
    plugins: DrivetrainPlugins | None,
) -> dict[str, Any]:
    """A file ``layer`` whose engine section was written for another backend than the one chosen, with the
    options it left at that backend's defaults taken out, so that they follow the chosen backend.

    NOTE: a run's config.yaml holds every option of its backend; reused with ``engine.backend=megatron`` it
    failed on ``engine.fsdp_size``, an option the user never wrote. An option that differs from the written
    backend's default was set by someone: it is kept, and one that the chosen backend lacks is an error.

    Raises:
        ConfigError: the section sets an option of its backend, away from its default, that the chosen
            backend does not have; the message names it.
    """
    from drivetrain_engine_core.backend import PluginError
    from drivetrain_engine_core.job import plugins as default_plugins

    changed = dict(layer)
    for name, (backend, backend_cls) in backends.items():
        section = layer.get(name)
        written = section.get("backend") if isinstance(section, Mapping) else None
        if written is None or written == backend:
            continue
        try:
            written_cls = (plugins or default_plugins()).engines.config_class(str(written))
        except PluginError:
            continue  # not installed here: its options cannot be told apart, check_keys names them
        defaults = _container(_schema(cls, {name: (str(written), written_cls)})[name])
        kept = _set_away_from(defaults, {k: v for k, v in section.items() if k != "backend"})  # type: ignore[union-attr]
        foreign = sorted(set(kept) - set(field_types(backend_cls)))
        if foreign:
            shown = ", ".join(f"{name}.{key}={kept[key]!r}" for key in foreign)
            raise ConfigError(
                f"the config file's {name} section was written for backend {written} and sets {shown}, which "
                f"backend {backend} does not have; drop it from the file (options left at {written}'s defaults "
                f"follow {backend} on their own)."
            )
        changed[name] = kept
    return changed


def _set_away_from(defaults: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``values`` that are not at their value in ``defaults`` (nested sections compared leaf by
    leaf; ``None`` is a value like any other)."""
    kept: dict[str, Any] = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            if nested := _set_away_from(default, value):
                kept[key] = nested
        elif key not in defaults or value != default:
            kept[key] = value
    return kept


def _container(node: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node)  # type: ignore[return-value]


def _default_backend(cls: type, section: str) -> str:
    """The ``backend`` of ``cls``'s default for ``section`` (its default factory's, else the class's)."""
    for f in dataclasses.fields(cls):
        if f.name == section and f.default_factory is not dataclasses.MISSING:
            return f.default_factory().backend  # type: ignore[attr-defined]
    return EngineConfig().backend


def _unset_only(
    derived: Mapping[str, Any], layers: Sequence[Mapping[str, Any]], prefix: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``derived`` without the keys a user layer sets (what the user wrote always wins)."""
    kept: dict[str, Any] = {}
    for key, value in derived.items():
        path = (*prefix, key)
        if isinstance(value, Mapping):
            kept[key] = _unset_only(value, layers, path)
        elif not lookup(layers, path)[0]:
            kept[key] = value
    return kept


def _warn_cpu_beside_a_gpu(layers: Sequence[Mapping[str, Any]], machine: Mapping[str, Any]) -> None:
    """Warn where a layer pins ``<engine>.device=cpu`` on a machine with a GPU: a config printed or saved on a
    machine without one (a login node's ``--print-config``, a run's config.yaml) holds ``device: cpu``."""
    for name, values in machine.items():
        found, device = lookup(layers, (name, "device"))
        if found and device == "cpu" and values["device"] == "cuda":
            logger.warning(
                "%s.device=cpu is set (by --config or an override) though a GPU is visible: the engine trains on "
                "the CPU. Drop %s.device to use the GPU (a config printed or saved on a machine without one pins "
                "cpu).",
                name,
                name,
            )


_INDEX = re.compile(r"\[\d+\]")


def _failing_key(schema: Any, layers: Sequence[Mapping[str, Any]]) -> str:
    """The dotted key of the first given value the schema refuses on its own, or ``""``.

    NOTE: OmegaConf names no key for some refusals (a tuple of the wrong length: "TupleConfig length 1 does not
    match type hint length 2"), so each value is merged alone to find the one to name.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for layer in layers:
        for key, value in _leaves(layer):
            try:
                OmegaConf.merge(schema, _nested(key, value))
            except OmegaConfBaseException:
                return key
    return ""


def _leaves(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-mapping value (a list is a value)."""
    leaves: list[tuple[str, Any]] = []
    for name, value in values.items():
        key = f"{prefix}{name}"
        leaves += _leaves(value, f"{key}.") if isinstance(value, Mapping) else [(key, value)]
    return leaves


def _nested(key: str, value: Any) -> dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _field_error(
    error: Exception,
    key: str,
    cls: type,
    layers: Sequence[Mapping[str, Any]],
    where: str,
    backends: Mapping[str, type],
) -> ConfigError:
    """One line naming the field (``key``), the value given, the type it needs and how to write one."""
    path = tuple(_INDEX.sub("", key).split(".")) if key else ()
    annotation = _annotation_at(cls, path, backends)
    given, value = lookup(layers, path)
    name = ".".join(p for p in (where, key) if p)
    if annotation is None or not given:
        message = (getattr(error, "msg", None) or str(error)).split("\n")[0]
        return ConfigError(f"{name or cls.__name__}: {message}")
    return ConfigError(
        f"{name}={value!r} is not a valid {type_name(annotation)}; {how_to_write(annotation, name)}"
    )


def _annotation_at(cls: type, path: tuple[str, ...], backends: Mapping[str, type]) -> Any:
    owner: type | None = cls
    annotation: Any = None
    for depth, part in enumerate(path):
        if owner is None:
            return None
        annotation = field_types(owner).get(part)
        if annotation is None:
            return None
        owner = backends.get(".".join(path[: depth + 1])) or nested_dataclass(annotation)
    return annotation


__all__ = ["Derive", "build_config"]
