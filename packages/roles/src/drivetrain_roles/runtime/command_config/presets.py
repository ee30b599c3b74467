"""Presets: named sets of values a command lays under the user's file and overrides.

A value that depends on another one the user chooses (a user's model trains at another learning rate than the
embedded one; an off-policy mode corrects its older samples) is not computed by an if-branch: it sits in a
named preset, picked by the value of one key (:class:`PresetChoice`: ``model.path``, ``trainer.mode``) and
applied as a layer after the dataclass defaults and before ``--config`` and the overrides, so what the user
writes always wins and a saved config re-runs as it was. ``--print-config`` names the preset beside each value
it gave (:func:`~.build.value_sources`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivetrain_engine_core.job import lookup


@dataclass(frozen=True)
class Preset:
    """A named set of values.

    Attributes:
        name: how ``--print-config`` names it (``user-model``, ``builtin:multistep``).
        values: ``{section: {key: value}}``.
    """

    name: str
    values: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PresetChoice:
    """One preset picked by the value of one key (the last layer's that sets it, else the key's default).

    Attributes:
        key: the dotted key whose value picks (``model.path``).
        presets: a value of ``key`` -> its preset.
        otherwise: the preset of any other value; ``None``: none.
    """

    key: str
    presets: Mapping[Any, Preset]
    otherwise: Preset | None = None

    def pick(self, cls: type, layers: Sequence[Mapping[str, Any]]) -> Preset | None:
        """The preset for the value ``layers`` give ``key`` (``cls``'s default where none does)."""
        path = self.key.split(".")
        given, value = lookup(layers, path)
        if not given:
            value = default_at(cls, path)
        if not isinstance(value, Hashable):
            return self.otherwise
        return self.presets.get(value, self.otherwise)


def chosen_presets(cls: type, layers: Sequence[Mapping[str, Any]]) -> list[Preset]:
    """The presets ``cls`` declares (its ``presets`` class variable of :class:`PresetChoice`) picked for
    ``layers``, in declaration order."""
    picked = (choice.pick(cls, layers) for choice in getattr(cls, "presets", ()))
    return [preset for preset in picked if preset is not None]


def default_at(cls: type, path: Sequence[str]) -> Any:
    """The default of the dotted field ``path`` of the dataclass ``cls`` (its section's default factory's)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    f = fields[path[0]]
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    for part in path[1:]:
        value = getattr(value, part)
    return value


__all__ = ["Preset", "PresetChoice", "chosen_presets", "default_at"]
