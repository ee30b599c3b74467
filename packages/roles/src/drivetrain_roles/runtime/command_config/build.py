"""A command's typed config from its layers, built by core's one config builder (OmegaConf structured configs).

A command's config is one frozen dataclass of sections (its field defaults are the command's defaults). Its
layers, lowest first: each engine section's backend and the command's engine defaults (a section typed
:class:`~..config.EngineConfig` becomes the class of the backend it names), the ``machine`` preset (each engine
section's ``device``: :func:`~.machine.machine_device`), the presets the command picks (:mod:`.presets`), then
the user's YAML file and overrides. TRL's and verl's names are refused first with the field to write
(:mod:`.foreign_names`); core's :func:`~drivetrain_engine_core.job.build_layers` then checks every key
(with the close match) and value and builds the dataclasses (their ``__post_init__`` checks ranges and
combinations).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from drivetrain_engine_core.backend import ConfigError, EngineConfig
from drivetrain_engine_core.job import (
    build_layers,
    exclusive_limits,
    field_types,
    leaves,
    lookup,
    nested_dataclass,
)

from .foreign_names import check_foreign_names
from .machine import machine_device
from .presets import chosen_presets

if TYPE_CHECKING:
    from drivetrain_engine_core.job import DrivetrainPlugins

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")

FILE, COMMAND_LINE, MACHINE = "--config", "command line", "preset machine"
"""Where the user's layers and the engine's device come from, as ``--print-config`` names them."""


class Layer(NamedTuple):
    """One layer of a command's config and where it comes from (``""``: the command's own defaults)."""

    origin: str
    values: dict[str, Any]


def build_config(
    cls: type[ConfigT],
    layers: Sequence[Mapping[str, Any]],
    *,
    where: str = "",
    plugins: DrivetrainPlugins | None = None,
    file_layers: int = 0,
) -> ConfigT:
    """The dataclass ``cls`` from its defaults, its presets and ``layers`` (later layers win), fully checked.

    Args:
        cls: a dataclass of sections or of plain fields; a ``presets`` class variable of
            :class:`~.presets.PresetChoice`, when it has one, picks named values laid under ``layers``.
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
    _refuse_derived_values(cls)
    stack, sections = command_layers(cls, layers, where=where, plugins=plugins, file_layers=file_layers)
    machine = next((layer.values for layer in stack if layer.origin == MACHINE), {})
    _warn_cpu_beside_a_gpu([layer.values for layer in stack if layer.origin in (FILE, COMMAND_LINE)], machine)
    sources = ["the config file" if layer.origin == FILE else None for layer in stack]
    values = [layer.values for layer in stack]
    return build_layers(cls, values, where=where, sections=sections, sources=sources)


def value_sources(
    cls: type,
    layers: Sequence[Mapping[str, Any]],
    *,
    plugins: DrivetrainPlugins | None = None,
    file_layers: int = 0,
) -> dict[str, str]:
    """Where each value that is not the command's own default comes from, by dotted key: ``preset <name>``,
    ``--config`` or ``command line`` (the last layer that sets it)."""
    stack, _ = command_layers(cls, layers, plugins=plugins, file_layers=file_layers)
    return {key: layer.origin for layer in stack if layer.origin for key, _ in leaves(layer.values)}


def command_layers(
    cls: type,
    layers: Sequence[Mapping[str, Any]],
    *,
    where: str = "",
    plugins: DrivetrainPlugins | None = None,
    file_layers: int = 0,
) -> tuple[list[Layer], dict[str, type]]:
    """Every layer of ``cls``'s config, lowest first, and the config class of each engine section.

    Raises:
        ConfigError: a layer sets TRL's or verl's name for a field, or a file's engine section sets an option of
            another backend that the chosen one lacks.
        PluginError: an ``engine.backend`` that no installed plugin provides.
    """
    plain = [exclusive_limits(dict(layer), cls) for layer in layers]
    backends = _backend_classes(cls, plain, plugins)
    plain = [
        _for_backend(layer, cls, backends, plugins) if index < file_layers else layer
        for index, layer in enumerate(plain)
    ]
    if not where:
        for layer in plain:
            check_foreign_names(layer, cls)
    stack = [Layer("", _engine_defaults(cls, backends))]
    if backends:
        stack.append(Layer(MACHINE, {name: {"device": machine_device()} for name in backends}))
    stack += [Layer(f"preset {preset.name}", dict(preset.values)) for preset in chosen_presets(cls, plain)]
    stack += [
        Layer(FILE if index < file_layers else COMMAND_LINE, layer) for index, layer in enumerate(plain)
    ]
    return stack, {name: backend_cls for name, (_, backend_cls) in backends.items()}


def _engine_defaults(cls: type, backends: Mapping[str, tuple[str, type]]) -> dict[str, Any]:
    """Each engine section's ``backend`` and the command's own engine defaults (those that differ from
    :class:`EngineConfig`'s; a backend's other options keep its class's defaults)."""
    if not backends:
        return {}
    from omegaconf import OmegaConf

    base = _container(OmegaConf.structured(EngineConfig))
    defaults = _container(OmegaConf.structured(cls))
    return {
        name: {**{k: v for k, v in defaults[name].items() if k in base and v != base[k]}, "backend": backend}
        for name, (backend, _) in backends.items()
    }


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
        defaults = _written_defaults(cls, name, str(written), written_cls)
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


def _written_defaults(cls: type, name: str, backend: str, backend_cls: type) -> dict[str, Any]:
    """The defaults of ``cls``'s engine section ``name`` had it named ``backend``: its class's with the command's."""
    from omegaconf import OmegaConf

    own = _engine_defaults(cls, {name: (backend, backend_cls)})[name]
    return _container(OmegaConf.merge(OmegaConf.structured(backend_cls), own))


def _container(node: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node)  # type: ignore[return-value]


def _default_backend(cls: type, section: str) -> str:
    """The ``backend`` of ``cls``'s default for ``section`` (its default factory's, else the class's)."""
    for f in dataclasses.fields(cls):
        if f.name == section and f.default_factory is not dataclasses.MISSING:
            return f.default_factory().backend  # type: ignore[attr-defined]
    return EngineConfig().backend


def _refuse_derived_values(cls: type) -> None:
    """Refuse a command class still declaring ``derived_values`` (deprecated in drivetrain-roles 0.5.0, read until
    0.6.1): its values would silently no longer follow, so the build stops naming the replacement."""
    if hasattr(cls, "derived_values"):
        raise ConfigError(
            f"{cls.__name__}.derived_values is no longer read (removed in drivetrain-roles 0.7.0): declare the "
            "values it computed as presets, a `presets` class variable of PresetChoice "
            "(drivetrain_roles.runtime.command_config), which --print-config names."
        )


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


__all__ = [
    "COMMAND_LINE",
    "FILE",
    "MACHINE",
    "Layer",
    "build_config",
    "command_layers",
    "value_sources",
]
