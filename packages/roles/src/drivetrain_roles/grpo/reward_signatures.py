"""A reward function is checked against the call drivetrain makes when it loads, before any warm start.

drivetrain calls ``function(*, prompts, completions, references)`` once per batch (lists of texts) and takes one
number per completion. Two peers' shapes are taken as they are:

- TRL's ``reward_funcs`` (``f(completions, **kwargs)``, ``f(prompts, completions, **kwargs)``): they take
  drivetrain's call directly (the references arrive in ``kwargs["references"]``).
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (its custom reward function,
  and its built-in scorers ``compute_score(solution_str, ground_truth, ...)``): called once per completion with
  ``solution_str`` the completion, ``ground_truth`` its reference, ``data_source`` ``None`` (drivetrain's data have
  no such column) and ``extra_info`` ``{"prompt": prompt}``; a returned dict gives its ``"score"``, as verl reads it.

Anything else is refused naming the function's own signature and both accepted forms.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

DRIVETRAIN_CALL: dict[str, list[str]] = {"prompts": [], "completions": [], "references": []}
"""The keywords of drivetrain's call, as :func:`takes_drivetrains_call` binds them."""

VERL_PARAMETERS = ("solution_str", "ground_truth")
"""The parameters that mark verl's ``compute_score`` signature."""

EXPECTED = (
    "define {name}(*, prompts, completions, references) returning one number per completion (TRL's reward_funcs "
    "f(completions, **kwargs) take that call as they are), or verl's compute_score(data_source, solution_str, "
    "ground_truth, extra_info=None) returning one number per completion"
)


def adapted_reward_function(function: Callable[..., Any], spec: str) -> Callable[..., Any]:
    """``function`` if it takes drivetrain's call, else verl's ``compute_score`` adapted to it.

    Raises:
        ValueError: neither form fits (the message names the function's signature, the call and the fix).
    """
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: let the call tell
        return function
    if _binds(signature, **DRIVETRAIN_CALL):
        return function
    if all(name in signature.parameters for name in VERL_PARAMETERS):
        return VerlComputeScore(function, signature)
    name = getattr(function, "__name__", "function")
    raise ValueError(
        f"algorithm.reward_function={spec!r}: {name}{signature} cannot take drivetrain's call "
        f"{name}(prompts=[...], completions=[...], references=[...]); {EXPECTED.format(name=name)}."
    )


class VerlComputeScore:
    """verl's per-completion ``compute_score`` as a drivetrain reward function (see the module docstring)."""

    def __init__(self, compute_score: Callable[..., Any], signature: inspect.Signature) -> None:
        self.compute_score = compute_score
        self.__name__ = getattr(compute_score, "__name__", "compute_score")
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        self._passed = {
            name
            for name in ("data_source", "solution_str", "ground_truth", "extra_info")
            if accepts_any or name in signature.parameters
        }

    def __call__(
        self, *, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
    ) -> list[Any]:
        return [
            _score(self.compute_score(**self._keywords(prompt, completion, reference)))
            for prompt, completion, reference in zip(prompts, completions, references, strict=True)
        ]

    def _keywords(self, prompt: str, completion: str, reference: str) -> dict[str, Any]:
        every = {
            "data_source": None,
            "solution_str": completion,
            "ground_truth": reference,
            "extra_info": {"prompt": prompt},
        }
        return {name: value for name, value in every.items() if name in self._passed}


def _score(returned: Any) -> Any:
    """A verl score: the number, or a returned dict's ``"score"`` (verl's reward managers read that key)."""
    return returned["score"] if isinstance(returned, dict) and "score" in returned else returned


def _binds(signature: inspect.Signature, **keywords: Any) -> bool:
    try:
        signature.bind(**keywords)
    except TypeError:
        return False
    return True
