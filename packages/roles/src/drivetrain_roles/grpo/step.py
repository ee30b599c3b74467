"""One GRPO step over any engine and any rollout: sample, score, normalise, update, hand the weights off.

Per step, on every data-parallel rank for its share of the prompts: the rollout samples ``n`` responses per
prompt (whole groups stay on one rank, so group baselines need no communication); the rewards
(``algorithm.reward_functions``, weighted: :mod:`drivetrain_roles.rl.rewards`), shaped as DAPO's options say,
become advantages by ``algorithm.adv_estimator`` (the whitening ones reduce over the data-parallel group); the
actor recomputes the old log-probs and the reference its log-probs; one policy update (``algorithm.loss_mode``,
:mod:`drivetrain_roles.rl.policy_update`); then ``engine.weight_buckets(version=step,
base_version=rollout.delta_base)`` streams what changed to the rollout, which serves only complete, newer versions
on the base it holds intact. What GRPO shares with PPO (the batch, the policy's update, the sampling, the
hand-off) lives in :mod:`drivetrain_roles.rl`; this module holds GRPO's own: the group filter, the staleness and
the critic-free advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from drivetrain_engine_core.job import agreed_checks
from drivetrain_engine_core.rollout import Rollout, RolloutOutput
from torch.distributed import ProcessGroup

from ..actor import Actor
from ..jobs.data import Example
from ..reference import Reference
from ..rl.advantage_estimators import outcome_advantages
from ..rl.batch import RolloutBatch, add_rollout_fields, response_batch
from ..rl.episode_batch import episode_batch, episodes_rollout_batch, extra_rewards
from ..rl.episodes import EpisodeBatch, episode_versions
from ..rl.pipeline import GeneratedBatch
from ..rl.policy_update import policy_calls, update_with
from ..rl.reward_shaping import equal_reward_groups, penalised_rewards
from ..rl.rewards import Scores
from ..rl.sampling import sampling_config
from ..rl.scoring import answer_rewards
from ..rl.trainer_config import generation_lag
from ..rl.versions import Versions
from .config import GRPOConfig


def sample(
    rollout: Rollout,
    examples: Sequence[Example],
    tokenizer: Any,
    config: GRPOConfig,
    *,
    seed: int,
    group: ProcessGroup | None = None,
) -> RolloutBatch:
    """Sample ``rollout.n`` responses per example, reward them and build the actor's batch (collective: a reward
    function failing on one rank raises the same error on every rank, none waits in the update; ``group``: the
    data-parallel ranks whose tokens a whitening estimator reduces over)."""
    output = rollout.generate([e.prompt_ids for e in examples], sampling_config(config, seed=seed))
    with agreed_checks():
        _, scores = answer_rewards(examples, output, tokenizer, config.algorithm.rewards())
    return rollout_batch(examples, output, scores.total, config, group, scores=scores)


def score(
    examples: Sequence[Example],
    output: RolloutOutput,
    tokenizer: Any,
    config: GRPOConfig,
    group: ProcessGroup | None = None,
) -> RolloutBatch:
    """Reward ``output`` (``output.n`` responses per example, prompt-major) and build the actor's batch."""
    _, scores = answer_rewards(examples, output, tokenizer, config.algorithm.rewards())
    return rollout_batch(examples, output, scores.total, config, group, scores=scores)


def rollout_batch(
    examples: Sequence[Example],
    output: RolloutOutput,
    rewards: torch.Tensor,
    config: GRPOConfig,
    group: ProcessGroup | None = None,
    *,
    versions: Versions | None = None,
    scores: Scores | None = None,
) -> RolloutBatch:
    """The actor's batch from the rewards (``scores``: each function's, carried for the metrics): the overlong
    penalty, the group filter and the groups too stale for ``versions`` leave the loss, then the advantages; with
    the rollout's per-token fields (:func:`drivetrain_roles.rl.batch.add_rollout_fields`)."""
    algorithm = config.algorithm
    lengths = [len(r) for r in output.responses]
    rewards = penalised_rewards(rewards, lengths, config)
    if versions is None:
        version = output.version or 0
        versions = Versions.of(output, version, current=version, max_staleness=None)
    filtered, stale = left_out_groups(rewards, output.n, versions, config)
    batch, responses = response_batch(examples, output, keep=~(filtered | stale).repeat_interleave(output.n))
    add_rollout_fields(batch, responses, output, versions)
    batch["advantages"] = outcome_advantages(
        rewards, batch["loss_mask"], output.n, algorithm.advantage_config(), group
    )
    return RolloutBatch(
        batch=batch,
        rollout_log_probs=output.log_probs,
        rewards=rewards,
        response_lengths=lengths,
        scores=scores,
        filtered_groups=int(filtered.sum()),
        versions=versions,
        dropped_groups=int(stale.sum()),
    )


def left_out_groups(
    rewards: torch.Tensor, n: int, versions: Versions, config: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(groups,)`` twice: the groups ``algorithm.filter_groups`` takes out of the loss (equal rewards), and
    those holding a token older than ``versions`` allows."""
    filtered = equal_reward_groups(rewards, n)
    if not config.algorithm.filter_groups:
        filtered = torch.zeros_like(filtered)
    return filtered, versions.stale_groups(n)


def episodes_batch(
    generated: EpisodeBatch, scores: Scores, config: GRPOConfig, group: ProcessGroup | None, *, step: int
) -> RolloutBatch:
    """The actor's batch of ``step`` from multi-turn episodes: model tokens only in the loss, each episode's
    reward the environment's plus the reward functions' score of its final turn (:mod:`..rl.episode_batch`);
    the group filter and the staleness (of each episode's oldest model token) as :func:`rollout_batch`'s."""
    trajectories, n = generated.trajectories, generated.output.n
    extra = extra_rewards(trajectories, scores.total, config)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32) + extra
    versions = Versions(
        generated=episode_versions(trajectories), current=step, max_staleness=generation_lag(config.trainer)
    )
    filtered, stale = left_out_groups(rewards, n, versions, config)
    batch, rewards = episode_batch(trajectories, extra, keep=~(filtered | stale).repeat_interleave(n))
    batch["advantages"] = outcome_advantages(
        rewards, batch["loss_mask"], n, config.algorithm.advantage_config(), group
    )
    return episodes_rollout_batch(
        trajectories,
        batch,
        rewards,
        scores,
        filtered_groups=int(filtered.sum()),
        versions=versions,
        dropped_groups=int(stale.sum()),
    )


def generated_batch(
    examples: Sequence[Example],
    generated: GeneratedBatch,
    scores: Scores,
    config: GRPOConfig,
    group: ProcessGroup | None,
    *,
    step: int,
) -> RolloutBatch:
    """The actor's batch of ``step`` from the rollout's ``generated`` responses (or episodes:
    :func:`episodes_batch`) and their ``scores``: the responses older than ``trainer.max_staleness`` allows
    leave the loss (:func:`rollout_batch`)."""
    if isinstance(generated, EpisodeBatch):
        return episodes_batch(generated, scores, config, group, step=step)
    versions = Versions.of(
        generated.output, generated.version, current=step, max_staleness=generation_lag(config.trainer)
    )
    return rollout_batch(
        examples, generated.output, scores.total, config, group, versions=versions, scores=scores
    )


def update(actor: Actor, reference: Reference | None, samples: RolloutBatch) -> dict[str, float]:
    """Old and reference log-probs, then one PPO-clip update; returns the actor's update metrics.

    Besides the actor's update metrics: ``entropy``, the token-mean entropy of the policy over the step's
    response tokens before the update (from the old-log-prob pass, as verl reports it, so that the update
    itself computes no entropy unless the loss has an entropy bonus), and ``rollout/log_prob_diff_max``, the
    largest gap between the rollout's log-probs and the actor's recomputation of them: a weight hand-off that
    served stale or partial weights shows up there. Both cover every data-parallel rank's rows.
    """
    metrics, statistics = update_with(policy_calls(actor, reference), samples)
    return {**metrics, **statistics.reduced(actor.engine.data_parallel_group).metrics()}
