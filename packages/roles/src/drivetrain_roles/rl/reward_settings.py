"""The rewards an RL command's ``algorithm`` section names, checked and resolved in one place (torch-free: the
config checks run it without importing torch).

``algorithm.reward_functions=[a, b]`` with ``algorithm.reward_weights=[1.0, 0.5]`` is TRL's ``reward_funcs`` with
``reward_weights``; ``algorithm.reward_function=a`` is the same as ``reward_functions=[a]``. The two are one
setting written two ways: a config layer (a file, an override) that sets one clears the other (as the micro-batch
limits do), so an override replaces a file's rewards whichever form each uses, and the embedded task's default
reward yields to either; one layer that sets both is refused. ``reward_functions=[]`` lists none: a multi-turn
job's episodes are then paid by their environment alone (the job's checks refuse it without an environment).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePath

from drivetrain_engine_core.backend import ConfigError

from ..reward_model.spec import check_model_folder, is_model_spec, model_name
from .builtin_rewards import BUILTIN_REWARDS

REWARD_FIELDS = ("reward_function", "reward_functions")
"""The two forms of the ``algorithm`` section's reward setting (its ``exclusive_fields``)."""
ENVIRONMENT_ONLY = "environment"
"""The reward's label without functions (``reward_functions=[]``): the environment's reward alone."""


@dataclass(frozen=True)
class RewardSettings:
    """The resolved reward setting.

    Attributes:
        functions: the reward functions, each a built-in name, ``package.module:function`` or
            ``path/to/file.py:function``.
        weights: one weight per function; a completion's reward is the weighted sum of the functions that apply.
        timeout_s: how long the functions may take together over a step's completions (``None``: no limit, and
            the functions run one after another on the calling thread).
        failure_value: the reward of a completion whose function raised or ran out of time (``None``: such a
            function stops the run with one error naming it and the row).
    """

    functions: tuple[str, ...]
    weights: tuple[float, ...]
    timeout_s: float | None = 300.0
    failure_value: float | None = None

    @classmethod
    def single(cls, function: str, timeout_s: float | None = 300.0) -> RewardSettings:
        """One function, weight 1 (``algorithm.reward_function``)."""
        return cls(functions=(function,), weights=(1.0,), timeout_s=timeout_s)

    @property
    def names(self) -> tuple[str, ...]:
        """Each function's name in the metrics (``reward/<name>``): see :func:`reward_names`."""
        return reward_names(self.functions)

    @property
    def models(self) -> tuple[str, ...]:
        """The entries that name reward model folders (:mod:`..reward_model`), each run on its own engine."""
        return tuple(f for f in self.functions if f not in BUILTIN_REWARDS and is_model_spec(f))

    @property
    def label(self) -> str:
        """The reward in words for plots and reports: ``exact_match``, ``1 x a + 0.5 x b``, or ``environment``
        without functions."""
        if not self.functions:
            return ENVIRONMENT_ONLY
        if len(self.functions) == 1 and self.weights == (1.0,):
            return self.names[0]
        return " + ".join(f"{w:g} x {n}" for w, n in zip(self.weights, self.names, strict=True))


def reward_settings(
    reward_function: str | None,
    reward_functions: tuple[str, ...] | None,
    reward_weights: tuple[float, ...] | None,
    timeout_s: float | None,
    failure_value: float | None,
) -> RewardSettings:
    """The settings the ``algorithm`` section's fields give.

    Raises:
        ConfigError: both forms set (or neither), a function written without its name, weights
            that do not match the functions, or a time limit or failure value out of range.
    """
    functions = _functions(reward_function, reward_functions)
    for spec in functions:
        check_reward_spec(spec)
    weights = (
        tuple(float(w) for w in reward_weights) if reward_weights is not None else (1.0,) * len(functions)
    )
    if len(weights) != len(functions) or not all(math.isfinite(w) for w in weights):
        raise ConfigError(
            f"algorithm.reward_weights={list(weights)} must hold one finite weight per reward function "
            f"({len(functions)}: {list(functions)}); give one each, or unset it (null: 1 each)."
        )
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(
            f"algorithm.reward_timeout_s must be > 0 seconds, got {timeout_s}; null runs the functions without a "
            "time limit."
        )
    if failure_value is not None and not math.isfinite(failure_value):
        raise ConfigError(
            f"algorithm.reward_failure_value must be a finite number or null, got {failure_value}."
        )
    reward_names(functions)  # refuses a function listed twice
    return RewardSettings(
        functions=functions, weights=weights, timeout_s=timeout_s, failure_value=failure_value
    )


def _functions(reward_function: str | None, reward_functions: tuple[str, ...] | None) -> tuple[str, ...]:
    if reward_function is not None and reward_functions is not None:
        raise ConfigError(
            f"algorithm.reward_function={reward_function!r} and algorithm.reward_functions="
            f"{list(reward_functions)} are both set; write one: reward_functions=[...] for several, or "
            "reward_function=... for one (the same as a list of one)."
        )
    if reward_functions is not None:
        return tuple(reward_functions)  # empty: the environment's reward alone (refused without one)
    if reward_function is None:
        raise ConfigError(
            "no reward: set algorithm.reward_function (one function, e.g. exact_match) or "
            "algorithm.reward_functions=[...] (several, weighted by algorithm.reward_weights)."
        )
    return (reward_function,)


def check_reward_spec(spec: str) -> None:
    """Refuse a reward function written without the name of the function (``rewards.py``), or a reward model
    folder (an entry without ``:``, :mod:`..reward_model.spec`) that holds no one-label sequence-classification
    model.

    Raises:
        ConfigError: naming the built-in functions and the two forms of a user's function, or the fix of the
            reward model's folder.
    """
    if spec in BUILTIN_REWARDS:
        return
    if is_model_spec(spec):
        check_model_folder(spec)
        return
    location, _, name = spec.rpartition(":")
    if not (location and name):
        raise ConfigError(
            f"algorithm.reward_function={spec!r}: write a built-in reward ({', '.join(BUILTIN_REWARDS)}), "
            "package.module:function or path/to/file.py:function."
        )


def reward_names(functions: tuple[str, ...]) -> tuple[str, ...]:
    """Each function's name in the metrics: a built-in's name, a reward model's (its folder's,
    :func:`..reward_model.spec.model_name`), else the function's (TRL's ``__name__``); where two share it,
    ``<module or file stem>.<function>``.

    Raises:
        ConfigError: a function listed twice.
    """
    short = [_short_name(spec) for spec in functions]
    counts = Counter(short)
    names = tuple(
        _qualified(spec) if counts[name] > 1 and ":" in spec else name
        for spec, name in zip(functions, short, strict=True)
    )
    repeated = [name for name, count in Counter(names).items() if count > 1]
    if repeated:
        raise ConfigError(
            f"algorithm.reward_functions={list(functions)} lists {repeated[0]!r} more than once; list each function "
            "once and weigh it with algorithm.reward_weights (two reward model folders of one name: rename one, "
            "the metrics name a model by its folder)."
        )
    return names


def _short_name(spec: str) -> str:
    if spec in BUILTIN_REWARDS:
        return spec
    return model_name(spec) if is_model_spec(spec) else spec.rpartition(":")[2]


def _qualified(spec: str) -> str:
    location, _, name = spec.rpartition(":")
    stem = PurePath(location).stem if location.endswith(".py") else location.rpartition(".")[2]
    return f"{stem}.{name}"
