"""A step's samples as the actor trains on them (:class:`RolloutBatch`), and the prompt+response batch every RL
command builds from the rollout's output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from drivetrain_engine_core.job import make_batch
from drivetrain_engine_core.kit import ROUTED_EXPERTS
from drivetrain_engine_core.rollout import RolloutOutput
from tensordict import TensorDict

from ..jobs.data import Example
from .rewards import Scores
from .versions import Versions


@dataclass(frozen=True)
class RolloutBatch:
    """A step's samples as the actor trains on them, plus what the metrics need.

    Attributes:
        batch: no-padding prompt+response sequences with ``loss_mask`` (response tokens; none in a filtered
            group), ``advantages``.
        rollout_log_probs: the rollout's log-probs of each response's tokens.
        rewards: one reward per response (with the overlong penalty, when on).
        scores: each reward function's values, for ``reward/<name>`` (:func:`.rewards.reward_metrics`).
        response_lengths: tokens per response.
        filtered_groups: groups that ``algorithm.filter_groups`` took out of the loss.
        versions: the weight version of every response token and the policy version that trains on them
            (``None``: not given; every token is then the output's version, or 0).
        dropped_groups: groups taken out of the loss as older than ``trainer.max_staleness``.
    """

    batch: TensorDict
    rollout_log_probs: list[torch.Tensor]
    rewards: torch.Tensor
    response_lengths: list[int]
    scores: Scores | None = None
    filtered_groups: int = 0
    versions: Versions | None = None
    dropped_groups: int = 0


def response_batch(
    examples: Sequence[Example], output: RolloutOutput, keep: torch.Tensor
) -> tuple[TensorDict, torch.Tensor]:
    """Prompt+response sequences, whose loss mask holds the responses of the ``keep`` sequences; and over the
    batch's tokens laid end to end, true at every response (where the rollout's log-probs go)."""
    prompts = [torch.tensor(e.prompt_ids, dtype=torch.long) for e in examples]
    sequences = [torch.cat([prompts[i // output.n], r.long()]) for i, r in enumerate(output.responses)]
    prompt_lengths = torch.tensor([len(prompts[i // output.n]) for i in range(len(sequences))])
    response_lengths = torch.tensor([len(r) for r in output.responses])
    lengths = prompt_lengths + response_lengths
    responses = response_tokens(prompt_lengths, response_lengths)
    mask = responses & keep.bool().repeat_interleave(lengths)
    return make_batch(sequences, loss_mask=list(mask.split(lengths.tolist()))), responses


def response_tokens(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Over the tokens of prompt+response sequences laid end to end: true at the responses (one
    ``repeat_interleave``, not a list per sequence)."""
    marks = torch.tensor([False, True]).repeat(len(prompt_lengths))
    return marks.repeat_interleave(torch.stack([prompt_lengths, response_lengths], dim=1).reshape(-1))


def jagged(rows: Sequence[torch.Tensor], batch: TensorDict) -> torch.Tensor:
    """Per-token ``rows`` as a jagged field on ``batch``'s offsets."""
    return torch.nested.nested_tensor_from_jagged(torch.cat(list(rows)), offsets=batch["input_ids"].offsets())


def add_rollout_fields(
    batch: TensorDict, responses: torch.Tensor, output: RolloutOutput, versions: Versions
) -> None:
    """Set what the update reads of the rollout on ``batch`` (``responses``: :func:`response_batch`'s marks): each
    token's weight version (``token_versions``), the rollout's log-probs (``rollout_log_probs``, 0 on prompt
    tokens) and, under router replay, its routed experts (``routed_experts``)."""
    lengths = torch.tensor([len(r) for r in output.responses], dtype=torch.long)
    prompt_lengths = batch["input_ids"].offsets().diff() - lengths
    batch["token_versions"] = jagged(versions.token_field(prompt_lengths.tolist()), batch)
    rollout_log_probs = torch.zeros(batch["input_ids"].values().numel())
    if output.log_probs:
        rollout_log_probs[responses] = torch.cat(list(output.log_probs)).float()
    batch["rollout_log_probs"] = jagged([rollout_log_probs], batch)
    if output.routed_experts is not None:  # router replay: the actor routes through the rollout's experts
        batch[ROUTED_EXPERTS] = jagged(output.routed_experts, batch)
