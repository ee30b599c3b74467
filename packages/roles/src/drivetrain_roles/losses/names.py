"""Algorithm options chosen by name (estimators, losses, aggregations): the known names, one check, one message
for a wrong name.

Imports no torch: the commands' configs check these names when they are built (``--help-config`` and
``--print-config`` among them), and the losses that compute with them import the names from here.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from drivetrain_engine_core.backend import ConfigError


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


AGGREGATION_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""The means (what ``drivetrain sft`` offers)."""
CONSTANT_LENGTH_MODE = "seq-mean-token-sum-norm"
"""Dr. GRPO's mode: token sums over ``sequences x loss_scale_factor``, a constant length (verl's name)."""
POLICY_AGGREGATION_MODES: tuple[str, ...] = (*AGGREGATION_MODES, CONSTANT_LENGTH_MODE, "token-sum")
"""Every mode :func:`~.aggregation.aggregate` knows (the policy losses take them all)."""
POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo", "cispo")
"""The policy surrogates ``loss_mode`` selects (verl's ``actor.policy_loss.loss_mode``; :mod:`.surrogates`)."""
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
"""The per-token KL estimators (:mod:`.kl`)."""
_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def check_aggregation_mode(
    mode: str, loss_scale_factor: float | None = None, *, option: str = "loss_agg_mode"
) -> None:
    """Refuse an unknown ``mode`` (naming the known ones and the closest), and the constant-length mode without
    its constant.

    Raises:
        ConfigError: (a ``ValueError``) the message starts with ``option=mode``.
    """
    choose(option, mode, POLICY_AGGREGATION_MODES)
    if mode == CONSTANT_LENGTH_MODE and not (loss_scale_factor is not None and loss_scale_factor > 0):
        raise ConfigError(
            f"{option}={mode!r} divides by a constant length, loss_scale_factor, which is {loss_scale_factor}; "
            "give loss_scale_factor > 0 (e.g. the longest response, TRL's max_completion_length)."
        )


def canonical_estimator(name: str) -> str:
    """Map aliases (``kl``, ``mse``, ``low_var_kl``, verl's names) to ``k1``/``k2``/``k3``.

    Raises:
        ConfigError: (a ``ValueError``) the estimator is unknown; the message names the known ones and the closest.
    """
    return choose("kl_estimator", name, KL_ESTIMATORS, _KL_ALIASES)
