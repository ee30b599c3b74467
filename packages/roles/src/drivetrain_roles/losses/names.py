"""Algorithm options chosen by name (estimators, losses, aggregations): one check, one message for a wrong name."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from drivetrain_engine_core.config import ConfigError


def choose(option: str, value: str, known: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    """The canonical name ``value`` selects for ``option`` (an alias maps to its canonical name).

    Raises:
        ConfigError: ``value`` is neither known nor an alias; the message starts with ``option=value`` (callers
            prefix their section, e.g. ``algorithm.``), lists the known names and suggests the closest one.
    """
    aliases = aliases or {}
    canonical = aliases.get(value, value)
    if canonical in known:
        return canonical
    close = difflib.get_close_matches(value, [*known, *aliases], n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    also = f" (aliases: {', '.join(f'{a}={c}' for a, c in aliases.items())})" if aliases else ""
    raise ConfigError(f"{option}={value!r} is not known; {hint}choose one of {', '.join(known)}{also}.")
