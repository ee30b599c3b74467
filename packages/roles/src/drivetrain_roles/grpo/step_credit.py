"""The graded reward of the embedded multi-step task (``algorithm.reward_function=step_credit``).

A completion is worked steps and an answer, ``"7+5=12; 12*3=36; answer: 36"``
(:func:`~drivetrain_roles.jobs.multistep_task.working`). Its reward is partial credit in [0, 1]: half for the
steps (the fraction of the reference's steps written exactly so, in place, over the longer of the two step
lists, so extra steps cost too), half for the final answer. Malformed output, anything that does not parse as
steps and an answer (a response that never ended its turn and ran on, or was cut at ``rollout.max_new_tokens``),
earns :data:`MALFORMED`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..jobs.multistep_task import ANSWER_PREFIX, STEP_SEPARATOR

MALFORMED = -1.0
"""The reward of a completion that is not steps and an answer."""

_STEP = re.compile(r"\d+[-+*]\d+=-?\d+")
_ANSWER = re.compile(re.escape(ANSWER_PREFIX) + r"(-?\d+)")


def parse_working(text: str) -> tuple[list[str], str] | None:
    """``(steps, answer)`` of ``"a+b=c; c*d=e; answer: e"`` (surrounding whitespace ignored), or ``None`` when
    ``text`` is not one or more steps followed by an answer."""
    *steps, last = text.strip().split(STEP_SEPARATOR)
    answer = _ANSWER.fullmatch(last)
    if not steps or answer is None or not all(_STEP.fullmatch(step) for step in steps):
        return None
    return steps, answer.group(1)


def step_credit(completion: str, reference: str) -> float:
    """The reward of one completion against the reference working (see the module docstring).

    Raises:
        ValueError: the reference is not steps and an answer (the data are not the multi-step task's).
    """
    expected = parse_working(reference)
    if expected is None:
        raise ValueError(
            f"the reference {reference[:80]!r} is not worked steps and an answer ('7+5=12; 12*3=36; answer: 36'): "
            "step_credit scores the embedded multi-step task's data (model.path=builtin:multistep)"
        )
    written = parse_working(completion)
    if written is None:
        return MALFORMED
    (steps, answer), (reference_steps, reference_answer) = written, expected
    right = sum(step == wanted for step, wanted in zip(steps, reference_steps, strict=False))
    return 0.5 * right / max(len(steps), len(reference_steps)) + 0.5 * (answer == reference_answer)


def step_credit_reward(
    *, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> list[float]:
    """``algorithm.reward_function=step_credit``: :func:`step_credit` of each completion against its reference."""
    del prompts  # the reference working alone decides
    return [step_credit(c, r) for c, r in zip(completions, references, strict=True)]
