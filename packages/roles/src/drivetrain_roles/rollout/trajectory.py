"""The trajectory of a multi-turn episode: ONE token sequence, and the no-padding batch built from several.

The sequence is the first prompt, then each model turn exactly as sampled (its ids and their sampled
log-probs, never re-tokenised from text), each followed by what the environment answered, rendered by the chat
template (:mod:`.chat_rendering`). Only the model's tokens are trained on: ``loss_mask`` is true at them and
false at the prompt and every observation, so a loss aggregated over the mask covers model tokens only.

As a batch (:func:`trajectory_batch`), like the single-turn rollout's prompt+response batch:

========================  ===========  ============================================================
field                     per          meaning
========================  ===========  ============================================================
``input_ids``             token        the whole episode
``loss_mask``             token        true at the model's tokens
``rollout_log_probs``     token        the sampled log-prob of each model token; 0 elsewhere
``token_versions``        token        the weight version that sampled each model token; a context
                                       token carries the version of the turn that read it first
``token_rewards``         token        each turn's reward at that turn's last token; 0 elsewhere
``rewards``               sequence     the episode's return: the sum of its turn rewards
``num_turns``             sequence     model turns in the episode
``prompt_lengths``        sequence     tokens of the first prompt
========================  ===========  ============================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from drivetrain_engine_core.job import Message, make_batch
from tensordict import TensorDict


@dataclass(kw_only=True, frozen=True)
class Trajectory:
    """One episode as one token sequence.

    Attributes:
        input_ids: ``(length,)`` every token of the episode.
        loss_mask: ``(length,)`` true at the model's sampled tokens.
        log_probs: ``(length,)`` float32 sampled log-probs at the model's tokens, 0 elsewhere.
        versions: ``(length,)`` int64 weight version per token (see the module's table).
        turn_spans: ``(start, stop)`` of each model turn's tokens in ``input_ids``.
        turn_rewards: each model turn's reward (the environment's ``StepResult.reward``; 0 for a turn the
            environment never answered).
        prompt_length: tokens of the first prompt.
        stop_reason: why the episode ended: ``done`` (the environment), ``max_turns``, ``max_total_tokens``,
            ``truncated`` (a turn ended without its end-of-turn token), ``step_timeout`` or ``step_error``.
        infos: each step's ``StepResult.info``, and the error of a failed step.
        messages: the episode as chat messages: the first prompt's, each model turn as an ``assistant`` message
            (its decoded text; ``tool_calls`` where its environment reads calls in it), each observation the
            model was shown. What a reward function reads as its ``trajectory`` keyword, with
            ``turn_rewards`` and ``stop_reason``.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    log_probs: torch.Tensor
    versions: torch.Tensor
    turn_spans: tuple[tuple[int, int], ...]
    turn_rewards: tuple[float, ...]
    prompt_length: int
    stop_reason: str
    infos: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    messages: tuple[Message, ...] = ()

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its turn rewards (the final reward when only the last turn has one)."""
        return float(sum(self.turn_rewards))

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    def token_rewards(self) -> torch.Tensor:
        """``(length,)`` each turn's reward at its last token, 0 elsewhere (per-token rewards, as GAE takes)."""
        rewards = torch.zeros(len(self.input_ids), dtype=torch.float32)
        rewards[[stop - 1 for _, stop in self.turn_spans]] = torch.tensor(
            self.turn_rewards, dtype=torch.float32
        )
        return rewards

    def model_turns(self) -> list[torch.Tensor]:
        """The ids of each model turn, in order."""
        return [self.input_ids[start:stop] for start, stop in self.turn_spans]


def trajectory_batch(trajectories: Sequence[Trajectory]) -> TensorDict:
    """The no-padding batch of ``trajectories`` (fields: the module's table), one sequence per episode."""
    return make_batch(
        [t.input_ids for t in trajectories],
        loss_mask=[t.loss_mask for t in trajectories],
        rollout_log_probs=[t.log_probs for t in trajectories],
        token_versions=[t.versions for t in trajectories],
        token_rewards=[t.token_rewards() for t in trajectories],
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
        prompt_lengths=torch.tensor([t.prompt_length for t in trajectories], dtype=torch.long),
    )
