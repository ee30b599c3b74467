"""Scoring a step's responses: the answers decoded and scored by the reward functions of
``algorithm.rewards()`` (:class:`RewardScorer`, the :class:`~.hooks.Scorer` both commands use unless a job
gives another), its reward model entries by the models the job built and handed to it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivetrain_engine_core.rollout import RolloutOutput

from ..jobs.data import Example
from ..reward_model.scorer import RewardModel
from ..rollout.trajectory import Trajectory
from .reward_inputs import RewardInputs
from .reward_settings import RewardSettings
from .rewards import Scores, score_completions


def answer_rewards(
    examples: Sequence[Example],
    output: RolloutOutput,
    tokenizer: Any,
    rewards: RewardSettings,
    models: Mapping[str, RewardModel] | None = None,
    trajectories: Sequence[Trajectory] | None = None,
) -> tuple[list[str], Scores]:
    """The decoded answers of ``output`` (``output.n`` per example, prompt-major) and their scores by
    ``rewards`` (``algorithm.rewards()``, its reward model entries by the job's built ``models``), each answer
    with its example's prompt, reference and columns, and in a multi-turn job its episode (``trajectories``,
    the ``trajectory`` keyword)."""
    ids = [r.tolist() for r in output.responses]
    answers = [tokenizer.decode(r, skip_special_tokens=True) for r in ids]
    inputs = RewardInputs.of(examples, answers, ids, trajectories)
    return answers, score_completions(rewards, inputs, models)


@dataclass(frozen=True)
class RewardScorer:
    """The :class:`~.hooks.Scorer` of the reward functions ``settings`` names, on answers ``tokenizer`` decodes.

    Attributes:
        settings: the functions and their weights (``algorithm.rewards()``).
        tokenizer: decodes the responses.
        models: the reward models the job built for ``settings``' model entries, by entry (none: such an entry
            raises when scored, naming where reward models run).
    """

    settings: RewardSettings
    tokenizer: Any
    models: Mapping[str, RewardModel] = field(default_factory=dict)

    def __call__(
        self,
        examples: Sequence[Example],
        output: RolloutOutput,
        trajectories: Sequence[Trajectory] | None = None,
    ) -> Scores:
        return answer_rewards(examples, output, self.tokenizer, self.settings, self.models, trajectories)[1]
