"""Scoring a step's responses: the answers decoded and scored by the reward functions of
``algorithm.rewards()`` (:class:`RewardScorer`, the :class:`~.hooks.Scorer` both commands use unless a job
gives another)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.rollout import RolloutOutput

from ..jobs.data import Example
from .reward_inputs import RewardInputs
from .reward_settings import RewardSettings
from .rewards import Scores, score_completions


def answer_rewards(
    examples: Sequence[Example], output: RolloutOutput, tokenizer: Any, rewards: RewardSettings
) -> tuple[list[str], Scores]:
    """The decoded answers of ``output`` (``output.n`` per example, prompt-major) and their scores by
    ``rewards`` (``algorithm.rewards()``), each answer with its example's prompt, reference and columns."""
    ids = [r.tolist() for r in output.responses]
    answers = [tokenizer.decode(r, skip_special_tokens=True) for r in ids]
    return answers, score_completions(rewards, RewardInputs.of(examples, answers, ids))


@dataclass(frozen=True)
class RewardScorer:
    """The :class:`~.hooks.Scorer` of the reward functions ``settings`` names, on answers ``tokenizer`` decodes.

    Attributes:
        settings: the functions and their weights (``algorithm.rewards()``).
        tokenizer: decodes the responses.
    """

    settings: RewardSettings
    tokenizer: Any

    def __call__(self, examples: Sequence[Example], output: RolloutOutput) -> Scores:
        return answer_rewards(examples, output, self.tokenizer, self.settings)[1]
