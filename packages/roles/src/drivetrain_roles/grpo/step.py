"""One GRPO step over any engine and any rollout: sample, score, normalise, update, hand the weights off.

Per step, on every data-parallel rank for its share of the prompts: the rollout samples ``n`` responses per
prompt (whole groups stay on one rank, so advantages need no communication); exact-answer rewards are
normalised within each group; the actor recomputes the old log-probs and the reference its log-probs; one
PPO-clip update with the KL penalty; then ``engine.weight_buckets(version=step)`` streams the new weights to
the rollout, which serves only complete, newer versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core import distributed
from drivetrain_engine_core.data.batch import make_batch
from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig
from tensordict import TensorDict

from ..actor import Actor
from ..reference import Reference
from ..sft.data import Example
from .config import GRPOConfig
from .rewards import exact_answer_rewards, group_advantages

SEED_STRIDE = 1_000_003
"""Sampling seeds are ``seed + SEED_STRIDE * step + rank``: distinct per step and rank, repeatable on resume."""


@dataclass(frozen=True)
class RolloutBatch:
    """A step's samples as the actor trains on them, plus what the metrics need.

    Attributes:
        batch: no-padding prompt+response sequences with ``loss_mask`` (response tokens), ``advantages``.
        rollout_log_probs: the rollout's log-probs of each response's tokens.
        rewards: one reward per response.
        response_lengths: tokens per response.
    """

    batch: TensorDict
    rollout_log_probs: list[torch.Tensor]
    rewards: torch.Tensor
    response_lengths: list[int]


def sample(
    rollout: Rollout, examples: Sequence[Example], tokenizer: Any, config: GRPOConfig, *, seed: int
) -> RolloutBatch:
    """Sample ``rollout.n`` responses per example, reward them and build the actor's batch."""
    n = config.rollout.n
    sampling = SamplingConfig(
        n=n, temperature=config.rollout.temperature, max_new_tokens=config.rollout.max_new_tokens, seed=seed
    )
    output = rollout.generate([e.prompt_ids for e in examples], sampling)
    answers = [tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in output.responses]
    rewards = exact_answer_rewards(answers, [examples[i // n].response_text for i in range(len(answers))])
    advantages = group_advantages(rewards, n, config.algorithm.epsilon)
    return RolloutBatch(
        batch=_batch(examples, output, advantages),
        rollout_log_probs=output.log_probs,
        rewards=rewards,
        response_lengths=[len(r) for r in output.responses],
    )


def _batch(examples: Sequence[Example], output: RolloutOutput, advantages: torch.Tensor) -> TensorDict:
    prompts = [examples[i // output.n].prompt_ids for i in range(len(output.responses))]
    sequences = [torch.tensor(p + r.tolist()) for p, r in zip(prompts, output.responses, strict=True)]
    masks = [
        torch.tensor([False] * len(p) + [True] * len(r))
        for p, r in zip(prompts, output.responses, strict=True)
    ]
    per_token = [a.expand(len(s)).clone() for a, s in zip(advantages, sequences, strict=True)]
    return make_batch(sequences, loss_mask=masks, advantages=per_token)


def update(actor: Actor, reference: Reference | None, samples: RolloutBatch) -> dict[str, float]:
    """Old and reference log-probs, then one PPO-clip update; returns the actor's update metrics.

    The metric ``rollout/log_prob_diff_max`` is the largest gap between the rollout's log-probs and the
    actor's recomputation of them: a weight hand-off that served stale or partial weights shows up here.
    """
    batch = samples.batch
    old = actor.compute_log_prob(batch)
    if old is None:
        raise RuntimeError(
            "drivetrain grpo needs log-probs on every data-parallel rank (an output rank each)."
        )
    batch["old_log_probs"] = old["log_probs"]
    if reference is not None:
        batch["ref_log_prob"] = reference.compute_ref_log_prob(batch)["ref_log_prob"]  # type: ignore[index]
    metrics = actor.update_policy(batch)
    gap = _log_prob_gap(batch, old["log_probs"], samples.rollout_log_probs)
    metrics["rollout/log_prob_diff_max"] = distributed.all_reduce_max(gap, actor.engine.data_parallel_group)
    return metrics


def _log_prob_gap(
    batch: TensorDict, actor_log_probs: torch.Tensor, rollout_log_probs: list[torch.Tensor]
) -> float:
    gap = 0.0
    for values, mask, rolled in zip(
        actor_log_probs.unbind(), batch["loss_mask"].unbind(), rollout_log_probs, strict=True
    ):
        gap = max(gap, float((values[mask] - rolled.to(values.device)).abs().max()))
    return gap


def hand_off(actor: Actor, rollout: Rollout, version: int, bucket_mb: float) -> None:
    """Stream the actor's weights to the rollout as ``version`` (collective over the actor's ranks)."""
    rollout.update_weights(actor.engine.weight_buckets(version=version, bucket_bytes=int(bucket_mb * 2**20)))
