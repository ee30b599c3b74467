"""The built-in ``math_verify`` reward: 1 where a completion's final answer is mathematically the reference's.

NOTE: why Hugging Face's ``math-verify`` (the ``drivetrain-roles[math]`` extra): it is maintained, and it is the
verifier TRL's ``accuracy_reward``, verl's ``math_verify`` scorer and AReaL use, so a reward means the same here
as there. It extracts the answer (``\\boxed{...}``, ``$...$``, a plain expression) and compares it symbolically
with sympy: ``\\boxed{1/2}``, ``0.5`` and ``\\frac{1}{2}`` are one answer, and so are ``(x+1)^2`` and
``x^2+2x+1``; string normalisation (verl's ``math_dapo``) or exact match would call them different. It is an
extra because only this reward needs it, and it pins an ANTLR runtime (``antlr4-python3-runtime`` 4.9.3-4.13.2)
that other LaTeX or grammar tools in a user's environment may pin otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

MATH_MODULE = "math_verify"
MATH_EXTRA = "drivetrain-roles[math]"

PER_CALL_TIMEOUT_S = 5
"""math-verify's own limit per parse and comparison, on the main thread only (it interrupts with
``signal.alarm``, which other threads cannot use; there :mod:`.reward_runner`'s time limit applies)."""


def math_verify_reward(*, completions: Sequence[str], references: Sequence[str]) -> list[float | None]:
    """1.0 where the completion's answer equals the reference's (math-verify's ``verify``), else 0.0; ``None``
    (not applicable, as TRL's ``accuracy_reward``) where the reference holds no answer math-verify can read."""
    from math_verify import parse, verify

    timeout = PER_CALL_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    rewards: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        gold = parse(reference, parsing_timeout=timeout)  # type: ignore[arg-type]
        if not gold:
            rewards.append(None)
            continue
        answer = parse(completion, parsing_timeout=timeout)  # type: ignore[arg-type]
        rewards.append(float(verify(gold, answer, timeout_seconds=timeout)))
    return rewards


def prepare_math_verify() -> None:
    """Import math-verify when the reward loads: its seconds of import are spent at setup, not inside a step's
    time limit; and drop its notice that its own timeout is off (off in threads, where the runner's applies).

    Raises:
        ModuleNotFoundError: math-verify is not installed.
    """
    import math_verify  # noqa: F401

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_TimeoutNotice())


class _TimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message: Any = record.msg
        return not (isinstance(message, str) and message.startswith("Timeout is disabled"))
