"""A reward function is taken as its author wrote it: its signature says which keywords it gets.

drivetrain calls a function once per batch with the keywords of :mod:`.reward_inputs` that its signature names
(all of them when it takes ``**kwargs``) and takes one number, or ``None`` (not applicable), per completion. Two
peers' shapes work unchanged:

- TRL's ``reward_funcs`` (``f(completions, **kwargs)``, ``f(prompts, completions, answer, **kwargs)``): called as
  TRL calls them, every data set column among the keywords.
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (its custom reward
  function, and its built-in scorers ``compute_score(solution_str, ground_truth, ...)``): called once per
  completion, as verl's reward manager calls it, with ``solution_str`` the completion, ``data_source`` and
  ``extra_info`` from the data set's columns of those names (``None`` and ``{}`` without them; ``extra_info``
  also holds the ``prompt``), and ``ground_truth`` from verl's ``reward_model`` column (its ``ground_truth``),
  else a ``ground_truth`` column, else the reference; a returned dict gives its ``"score"``, as verl reads it.

A function whose parameters cannot be given by keyword is refused when it loads; one that asks for a keyword the
data set does not offer, when the data has loaded (:meth:`LoadedReward.missing`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import DrivetrainError

from .reward_inputs import RewardInputs

VERL_PARAMETERS = ("solution_str", "ground_truth")
"""The parameters that mark verl's ``compute_score`` signature."""
VERL_GROUND_TRUTH = ("reward_model", "ground_truth", "references")
"""Where verl's ``ground_truth`` comes from, first found first: verl's column, a column of that name, the reference."""

EXPECTED = (
    "define {name}(*, prompts, completions, references) (or any of the keywords prompts, completions, "
    "completion_messages, completion_ids, references and the data set's columns, or **kwargs) returning one "
    "number per completion, or verl's compute_score(data_source, solution_str, ground_truth, extra_info=None)"
)


class RewardError(DrivetrainError, ValueError):
    """The reward function cannot be loaded or returned unusable rewards; the message names it and the fix."""


@dataclass(frozen=True)
class LoadedReward:
    """A reward function with what its signature asks for.

    Attributes:
        spec: as ``algorithm.reward_functions`` names it.
        name: its name in the metrics (``reward/<name>``).
        function: called with keyword lists of one batch; returns one value per completion.
        parameters: the keywords it takes (``None``: every keyword, it takes ``**kwargs``).
        required: the keywords it cannot do without.
        per_completion: verl's ``compute_score``, one call per completion (the runner may run them in parallel).
        collective: a reward model's forward, which every rank runs together: called once per batch on the
            calling thread, outside the time limit (its engine's ``dist_timeout_s`` bounds it), never retried
            row by row.
    """

    spec: str
    name: str
    function: Callable[..., Any]
    parameters: frozenset[str] | None
    required: frozenset[str]
    per_completion: bool = False
    collective: bool = False

    def __call__(self, inputs: RewardInputs) -> Any:
        keywords = inputs.keywords
        if self.parameters is not None:
            keywords = {k: v for k, v in keywords.items() if k in self.parameters}
        return self.function(**keywords)

    def missing(self, available: Collection[str]) -> list[str]:
        """The keywords it needs that ``available`` lacks (verl's: a source of ``ground_truth``)."""
        if self.per_completion:
            needs_truth = "ground_truth" in self.required
            return (
                [] if not needs_truth or any(k in available for k in VERL_GROUND_TRUTH) else ["ground_truth"]
            )
        return sorted(self.required - set(available))


def loaded_reward(function: Callable[..., Any], spec: str, name: str) -> LoadedReward:
    """``function`` with its signature read: verl's ``compute_score`` adapted, anything else called by keyword.

    Raises:
        RewardError: a parameter without a default that cannot be given by keyword (the message names the
            function's signature and the accepted forms).
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: let the call tell
        return LoadedReward(spec, name, function, parameters=None, required=frozenset())
    parameters = signature.parameters.values()
    if all(p in signature.parameters for p in VERL_PARAMETERS):
        verl = VerlComputeScore(function, signature)
        return LoadedReward(spec, name, verl, None, frozenset(verl.required), per_completion=True)
    by_position = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)]
    if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in by_position):
        label = getattr(function, "__name__", "function")
        raise RewardError(
            f"reward function {spec!r}: {label}{signature} has parameters that can only be given by position, "
            f"and drivetrain passes keywords; {EXPECTED.format(name=label)}."
        )
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    return LoadedReward(
        spec,
        name,
        function,
        parameters=None if takes_any else frozenset(p.name for p in named),
        required=frozenset(p.name for p in named if p.default is p.empty),
    )


class VerlComputeScore:
    """verl's per-completion ``compute_score`` as a batch function (see the module docstring)."""

    def __init__(self, compute_score: Callable[..., Any], signature: inspect.Signature) -> None:
        self.compute_score = compute_score
        self.__name__ = getattr(compute_score, "__name__", "compute_score")
        parameters = signature.parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        verl_names = ("data_source", "solution_str", "ground_truth", "extra_info")
        self._passed = {name for name in verl_names if accepts_any or name in parameters}
        self.required = {
            name
            for name in verl_names
            if name in parameters and parameters[name].default is inspect.Parameter.empty
        }

    def __call__(self, **keywords: Sequence[Any]) -> list[Any]:
        return [
            _score(self.compute_score(**self._keywords(keywords, row)))
            for row in range(len(keywords["completions"]))
        ]

    def _keywords(self, keywords: Mapping[str, Sequence[Any]], row: int) -> dict[str, Any]:
        extra_info = keywords["extra_info"][row] if "extra_info" in keywords else None
        every = {
            "data_source": keywords["data_source"][row] if "data_source" in keywords else None,
            "solution_str": keywords["completions"][row],
            "ground_truth": _ground_truth(keywords, row),
            "extra_info": {
                "prompt": keywords["prompts"][row],
                **(extra_info if isinstance(extra_info, Mapping) else {}),
            },
        }
        return {name: value for name, value in every.items() if name in self._passed}


def _ground_truth(keywords: Mapping[str, Sequence[Any]], row: int) -> Any:
    """verl's ``ground_truth`` of a row: its ``reward_model`` column's, a ``ground_truth`` column, or the reference."""
    reward_model = keywords["reward_model"][row] if "reward_model" in keywords else None
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    for key in VERL_GROUND_TRUTH[1:]:
        if key in keywords:
            return keywords[key][row]
    return None


def _score(returned: Any) -> Any:
    """A verl score: the number, or a returned dict's ``"score"`` (verl's reward managers read that key)."""
    return returned["score"] if isinstance(returned, dict) and "score" in returned else returned
