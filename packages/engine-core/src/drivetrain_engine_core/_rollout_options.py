"""A rollout plugin's own options: the frozen dataclass its rollout class declares, built from plain values.

Inference backends have settings no other backend shares (vLLM's share of GPU memory, a server's request
timeout). A plugin declares them once, as a subclass of :class:`RolloutOptions` named by its rollout class's
``options_class``; a job carries them as plain values (``rollout.options.<key>=<value>``, a YAML mapping), and
:func:`build_rollout_options` turns those into the dataclass. A misspelt key or a value of the wrong type is
then one error naming the rollout, the distribution that registered it, every option it accepts (type and
default) and the fix, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._config_build import build_dataclass
from ._config_fields import field_types, type_name
from ._errors import ConfigError

SECTION = "rollout.options"
"""Where a job's config holds the options (``rollout.options.<key>``), for messages."""


@dataclass(kw_only=True, frozen=True)
class RolloutOptions:
    """The base of a rollout's own options; a rollout that declares none has this one, which has no fields.

    A plugin subclasses it (``@dataclass(kw_only=True, frozen=True)``, every field typed and defaulted, its
    checks in ``__post_init__`` raising ``ConfigError``), names the subclass in its rollout class's
    ``options_class``, and takes ``options: <the subclass> | None = None`` in the rollout's constructor
    (:func:`~.rollout.create_rollout` passes it built and checked). Field types are those a config file can
    write: ``bool``, ``int``, ``float``, ``str``, ``Literal``, tuples and lists of them, ``X | None``, nested
    frozen dataclasses.
    """

    def length_limit(self) -> tuple[str, int] | None:
        """The option that bounds the tokens of one sequence (prompt plus response) in a rollout built with these
        options, and its value (vLLM's ``("max_model_len", 4096)``); ``None`` where only the model's own context
        length bounds it (the base).

        Jobs check their longest prompt plus ``rollout.max_new_tokens`` against it when the prompts load, before
        any model does: the rollout itself would refuse such a prompt only at the step that first samples it.
        """
        return None

    def serving_versions(self, versions: int, *, why: str) -> RolloutOptions:
        """These options for a job whose rollout samples from up to ``versions`` weight versions at once (an
        asynchronous trainer's ``max_staleness + 1``: requests of older versions finish under theirs); ``why``
        names the setting that asks (``trainer.max_staleness=2``), for messages.

        A rollout that keeps versions apart (vLLM's adapter versions) sizes what it keeps from ``versions`` where
        its own option is unset, and refuses one set smaller. The base keeps nothing apart and returns itself.

        Raises:
            ConfigError: an option set to keep fewer versions (naming it, ``why`` and the fix).
        """
        del versions, why  # nothing kept apart
        return self


def build_rollout_options(
    options_class: type[RolloutOptions],
    values: Mapping[str, Any] | RolloutOptions | None,
    *,
    rollout: str,
    provider: str,
) -> RolloutOptions:
    """``options_class`` from ``values`` over its defaults (an instance of it is taken as is).

    Args:
        options_class: the rollout's ``options_class``.
        values: plain values by option name (a job's ``rollout.options``); ``None`` takes every default.
        rollout: the rollout's registered name (``vllm-server``), for messages.
        provider: the distribution that registered it (``drivetrain-rollout-vllm 0.2.0``), for messages.

    Raises:
        ConfigError: an option ``options_class`` does not declare, a value that does not fit its type, a value
            its own checks refuse, or an instance of another options class; the message names the rollout,
            its distribution, every accepted option with its type and default, and the fix.
    """
    where = f"rollout {rollout!r} ({provider})"
    if isinstance(values, RolloutOptions):
        if not isinstance(values, options_class):
            raise ConfigError(
                f"{where} takes options of type {options_class.__qualname__}, got a "
                f"{type(values).__qualname__}; pass {options_class.__qualname__}(...) or a mapping of its "
                f"options ({accepted_options(options_class)})."
            )
        return values
    given = dict(values or {})
    declared = field_types(options_class)
    unknown = sorted(key for key in given if key not in declared)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(declared), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        fix = (
            f"it accepts {accepted_options(options_class)}.{hint} Drop {SECTION}.{key}, or write one of those keys."
            if declared
            else f"it takes no options: drop {SECTION}.{key}."
        )
        raise ConfigError(f"{where} has no option {key!r} ({SECTION}.{key}); {fix}")
    try:
        return build_dataclass(options_class, given, where=SECTION)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e} Its options: {accepted_options(options_class)}.") from e


def accepted_options(options_class: type[RolloutOptions]) -> str:
    """Every option of ``options_class`` as ``name: type = default``, comma-separated (``none`` for none)."""
    types_ = field_types(options_class)
    shown = [f"{f.name}: {type_name(types_[f.name])}{_default(f)}" for f in dataclasses.fields(options_class)]
    return ", ".join(shown) or "none"


def _default(f: dataclasses.Field) -> str:
    """`` = <default>``, or `` (required)`` for a field without one."""
    if f.default_factory is not dataclasses.MISSING:
        return f" = {f.default_factory()!r}"
    if f.default is not dataclasses.MISSING:
        return f" = {f.default!r}"
    return " (required)"


__all__ = ["RolloutOptions", "accepted_options", "build_rollout_options"]
