"""The graded reward of the embedded multi-step task (``algorithm.reward_function=step_credit``).

A completion is worked steps and an answer, ``"7+5=12; 12*3=36; answer: 36"``
(:func:`~drivetrain_roles.jobs.multistep_task.working`). Its reward is partial credit in [0, 1]: half for the
steps, half for the final answer. Each step is compared with the reference's step in its place, part by part
(running total, operator, number, result: a quarter each, so a slip in one result still credits the method),
and the steps' credit is their sum over the longer of the two step lists (an extra or a missing step costs).
Malformed output, anything that does not parse as steps and an answer (a response that never ended its turn
and ran on, or was cut at ``rollout.max_new_tokens``), earns :data:`MALFORMED`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..jobs.multistep_task import ANSWER_PREFIX, STEP_SEPARATOR

MALFORMED = -1.0
"""The reward of a completion that is not steps and an answer."""

_STEP = re.compile(r"(\d+)([-+*])(\d+)=(-?\d+)")
_ANSWER = re.compile(re.escape(ANSWER_PREFIX) + r"(-?\d+)")


Step = tuple[str, ...]
"""A step's running total, operator, number and result, as written."""


def parse_working(text: str) -> tuple[list[Step], str] | None:
    """``(steps, answer)`` of ``"a+b=c; c*d=e; answer: e"`` (surrounding whitespace ignored), or ``None`` when
    ``text`` is not one or more steps followed by an answer."""
    *written, last = text.strip().split(STEP_SEPARATOR)
    answer = _ANSWER.fullmatch(last)
    steps = [_STEP.fullmatch(step) for step in written]
    if not steps or answer is None or None in steps:
        return None
    return [step.groups() for step in steps if step is not None], answer.group(1)


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
    parts = sum(
        sum(part == want for part, want in zip(step, wanted, strict=True)) / len(wanted)
        for step, wanted in zip(steps, reference_steps, strict=False)
    )
    return 0.5 * parts / max(len(steps), len(reference_steps)) + 0.5 * (answer == reference_answer)


def step_credit_reward(
    *, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> list[float]:
    """``algorithm.reward_function=step_credit``: :func:`step_credit` of each completion against its reference."""
    del prompts  # the reference working alone decides
    return [step_credit(c, r) for c, r in zip(completions, references, strict=True)]
