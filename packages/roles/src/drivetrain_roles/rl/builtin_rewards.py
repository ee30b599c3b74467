"""The reward functions ``algorithm.reward_function`` names without a module, in a torch-free module: the config
checks name them (``--help-config``, ``--print-config``) without importing torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..jobs.multistep_task import REWARD_FUNCTION as STEP_CREDIT
from .math_answers import MATH_EXTRA, math_verify_reward, prepare_math_verify
from .step_credit import step_credit_reward

EXACT_MATCH = "exact_match"
"""The built-in exact-answer reward's name in ``algorithm.reward_function``."""
MATH_VERIFY = "math_verify"
"""The built-in math-answer reward's name (:mod:`.math_answers`)."""

RewardFunction = Callable[..., Sequence[float | None]]
"""``function(*, prompts, completions, references, ...) -> one number (or None) per completion`` (lists)."""


def exact_match(answer: str, reference: str) -> bool:
    """Whether a decoded answer, stripped of surrounding spaces, equals the reference answer stripped."""
    return answer.strip() == reference.strip()


def exact_match_reward(
    *, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> list[float]:
    """The built-in reward function: 1 where the completion, stripped, is the reference answer, else 0."""
    del prompts  # the answer alone decides
    return [float(exact_match(c, r)) for c, r in zip(completions, references, strict=True)]


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    EXACT_MATCH: exact_match_reward,
    STEP_CREDIT: step_credit_reward,
    MATH_VERIFY: math_verify_reward,
}
"""The reward functions ``algorithm.reward_function`` names without a module: exact answers, the embedded
multi-step task's graded one (:mod:`.step_credit`) and math answers (:mod:`.math_answers`)."""

BUILTIN_SETUP: dict[str, tuple[Callable[[], None], str]] = {MATH_VERIFY: (prepare_math_verify, MATH_EXTRA)}
"""Built-in rewards that need a package: what loading them runs, and the distribution whose extra installs it."""
