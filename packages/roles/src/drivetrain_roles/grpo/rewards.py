"""GRPO's reward and advantages: a reward per response (exact answers, or the user's function), normalised within
each prompt's group of responses."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Sequence
from functools import cache
from numbers import Real
from pathlib import Path

import torch
from drivetrain_engine_core.errors import DrivetrainError

# NOTE: re-exported: GRPO's estimator moved to the roles' estimators, next to RLOO and REINFORCE++.
from ..advantage_estimators import group_advantages as group_advantages
from .builtin_rewards import BUILTIN_REWARDS as BUILTIN_REWARDS
from .builtin_rewards import EXACT_MATCH as EXACT_MATCH
from .builtin_rewards import RewardFunction as RewardFunction
from .builtin_rewards import exact_match as exact_match
from .builtin_rewards import exact_match_reward as exact_match_reward
from .reward_signatures import adapted_reward_function


class RewardError(DrivetrainError, ValueError):
    """The reward function cannot be loaded or returned unusable rewards; the message names it and the fix."""


def exact_answer_rewards(answers: Sequence[str], references: Sequence[str]) -> torch.Tensor:
    """``(len(answers),)`` float32: 1 where the answer is exactly the reference, else 0."""
    return torch.tensor(
        [float(exact_match(a, r)) for a, r in zip(answers, references, strict=True)], dtype=torch.float32
    )


@cache
def load_reward_function(spec: str) -> RewardFunction:
    """The reward function ``algorithm.reward_function`` names: a built-in (:data:`BUILTIN_REWARDS`),
    ``package.module:function``, or ``path/to/file.py:function`` (verl's custom reward function: a file and a
    name), loaded once per process and checked against the call drivetrain makes (verl's ``compute_score``
    adapted: :mod:`.reward_signatures`).

    Raises:
        RewardError: the module or file cannot be imported, has no callable of that name, or the callable cannot
            take drivetrain's call.
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    location, _, name = spec.rpartition(":")
    try:
        module = (
            _import_file(Path(location)) if location.endswith(".py") else importlib.import_module(location)
        )
    except Exception as e:
        raise RewardError(
            f"algorithm.reward_function={spec!r}: importing {location!r} failed ({type(e).__name__}: {e}); give an "
            "importable module (package.module:function) or a Python file (path/to/file.py:function)."
        ) from e
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(
            f"algorithm.reward_function={spec!r}: {location!r} has no function {name!r}; define "
            f"{name}(*, prompts, completions, references) returning one number per completion."
        )
    try:
        return adapted_reward_function(function, spec)
    except ValueError as e:
        raise RewardError(str(e)) from e


def _import_file(path: Path) -> object:
    """Import a Python file as a module, registered in ``sys.modules`` as an import would (a ``@dataclass`` in it
    looks its module up there, and pickling its functions needs it)."""
    spec = importlib.util.spec_from_file_location(f"drivetrain_reward_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def compute_rewards(
    spec: str, *, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> torch.Tensor:
    """``(len(completions),)`` float32 rewards from the function ``spec`` names.

    Raises:
        RewardError: the function raised, or did not return one finite number per completion.
    """
    function = load_reward_function(spec)
    try:
        returned = function(prompts=list(prompts), completions=list(completions), references=list(references))
        rewards = returned.tolist() if isinstance(returned, torch.Tensor) else list(returned)
    except Exception as e:
        raise RewardError(
            f"algorithm.reward_function={spec!r} raised {type(e).__name__}: {e} (on {len(completions)} completions)."
        ) from e
    # numbers.Real: Python and NumPy numbers alike (np.float32 is no float); a bool is a verdict, not a reward.
    bad = [r for r in rewards if isinstance(r, bool) or not isinstance(r, Real) or not math.isfinite(r)]
    if len(rewards) != len(completions) or bad:
        problem = f"{len(rewards)} values" if len(rewards) != len(completions) else f"{bad[:3]}"
        raise RewardError(
            f"algorithm.reward_function={spec!r} returned {problem} for {len(completions)} completions; it must "
            "return one finite number per completion (a list of numbers, or a 1-D tensor), in their order."
        )
    return torch.tensor([float(r) for r in rewards], dtype=torch.float32)
