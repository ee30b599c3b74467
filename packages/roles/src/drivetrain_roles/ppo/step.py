"""One PPO step over any engine and any rollout: sample, score, value, GAE, update the critic and the actor.

Per step, on every data-parallel rank for its share of the prompts: the rollout samples ``rollout.n``
responses per prompt and each is scored (``algorithm.reward_functions``, weighted, with DAPO's overlong penalty
when on);
the actor recomputes the old log-probs, the reference its log-probs (when a KL term reads them) and the critic
its values; the score, on each response's last token, less ``kl_ctrl``'s coefficient x the KL to the reference
on every token (``algorithm.use_kl_in_reward``), gives GAE's advantages (whitened over every rank's tokens) and
the critic's returns; then the critic's clipped value update and, after ``trainer.critic_warmup`` steps, the
actor's. Sampling, rewards, the batch, the rollout statistics and the weight hand-off are the RL layer's, shared
with ``drivetrain grpo`` (:mod:`drivetrain_roles.rl`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core.job import agreed_checks
from drivetrain_engine_core.rollout import Rollout, RolloutOutput
from tensordict import TensorDict
from torch.distributed import ProcessGroup

from ..actor import Actor
from ..advantages import apply_kl_penalty, compute_gae, token_rewards, whiten
from ..critic import Critic
from ..jobs.data import Example
from ..reference import Reference
from ..rl.batch import RolloutBatch, response_batch
from ..rl.episode_batch import episode_batch, episodes_rollout_batch, extra_rewards
from ..rl.episodes import EpisodeBatch
from ..rl.policy_update import PolicyCalls, RolloutStatistics, policy_calls
from ..rl.reward_shaping import penalised_rewards
from ..rl.rewards import Scores
from ..rl.sampling import sampling_config
from ..rl.scoring import answer_rewards
from .config import AlgorithmConfig, PPOConfig
from .statistics import value_statistics

CRITIC_PREFIX = "critic/"


@dataclass(frozen=True)
class PPOCalls:
    """Where a PPO update's calls go: this process's roles, or a worker group's parts.

    Attributes:
        policy: the actor's and the reference's calls (the RL layer's, shared with ``drivetrain grpo``).
        compute_values: the critic's per-token ``values`` of a batch.
        update_critic: one critic update; returns its metrics.
    """

    policy: PolicyCalls
    compute_values: Callable[[TensorDict], TensorDict | None]
    update_critic: Callable[[TensorDict], dict[str, float]]


def sample(
    rollout: Rollout, examples: Sequence[Example], tokenizer: Any, config: PPOConfig, *, seed: int
) -> RolloutBatch:
    """Sample ``rollout.n`` responses per example and score them (collective: a reward function failing on one
    rank raises the same error on every rank)."""
    output = rollout.generate([e.prompt_ids for e in examples], sampling_config(config, seed=seed))
    with agreed_checks():
        _, scores = answer_rewards(examples, output, tokenizer, config.algorithm.rewards())
    return scored_batch(examples, output, scores, config)


def scored_batch(
    examples: Sequence[Example], output: RolloutOutput, scores: Scores, config: PPOConfig
) -> RolloutBatch:
    """The step's batch: every response's tokens in the loss; its score with the overlong penalty, when on."""
    lengths = [len(r) for r in output.responses]
    rewards = penalised_rewards(scores.total, lengths, config)
    batch, _ = response_batch(examples, output, keep=torch.ones(len(lengths), dtype=torch.bool))
    return RolloutBatch(
        batch=batch,
        rollout_log_probs=output.log_probs,
        rewards=rewards,
        response_lengths=lengths,
        scores=scores,
    )


def episodes_batch(generated: EpisodeBatch, scores: Scores, config: PPOConfig) -> RolloutBatch:
    """The step's batch from multi-turn episodes: every episode's model tokens in the loss, its
    ``token_rewards`` (each turn's environment reward, plus the reward functions' score of the final turn:
    :mod:`..rl.episode_batch`) what GAE takes."""
    trajectories = generated.trajectories
    extra = extra_rewards(trajectories, scores.total, config)
    batch, rewards = episode_batch(trajectories, extra, keep=torch.ones(len(trajectories), dtype=torch.bool))
    return episodes_rollout_batch(trajectories, batch, rewards, scores)


def estimate_advantages(
    batch: TensorDict,
    scores: torch.Tensor,
    algorithm: AlgorithmConfig,
    kl_coef: float,
    group: ProcessGroup | None = None,
) -> dict[str, float]:
    """Set the batch's ``advantages`` (GAE over each sequence's loss tokens, whitened over ``group``'s tokens)
    and ``returns`` from the scores (or the batch's ``token_rewards``: episodes),
    the KL penalty in the reward and the critic's ``values``; returns the statistics (``kl``: the token-mean KL
    to the reference when it is in the reward, which an adaptive controller follows)."""
    mask = batch["loss_mask"]
    # Episodes carry each turn's reward on its last token; a response, its score on its last token.
    rewards = batch.get("token_rewards", None)
    if rewards is None:
        rewards = token_rewards(scores, mask)
    metrics: dict[str, float] = {}
    if algorithm.use_kl_in_reward:
        rewards, metrics["kl"] = apply_kl_penalty(
            rewards,
            batch["old_log_probs"],
            batch["ref_log_prob"],
            mask,
            coef=kl_coef,
            estimator=algorithm.kl_penalty,
            group=group,
        )
    advantages, returns = compute_gae(
        rewards, batch["values"], mask, gamma=algorithm.gamma, lam=algorithm.lam
    )
    batch["advantages"] = whiten(advantages, mask, group=group)
    batch["returns"] = returns
    return {**metrics, **value_statistics(advantages, returns, batch["values"], mask, group)}


def update_with(
    calls: PPOCalls,
    samples: RolloutBatch,
    algorithm: AlgorithmConfig,
    kl_coef: float,
    *,
    train_actor: bool,
    group: ProcessGroup | None = None,
) -> tuple[dict[str, float], RolloutStatistics]:
    """One PPO update through ``calls``: old and reference log-probs, values, advantages, the critic's update
    and (``train_actor``) the actor's. Returns the metrics (the critic's prefixed ``critic/``) and the
    statistics of the rows the caller holds (see :func:`drivetrain_roles.rl.policy_update.update_with`)."""
    batch = samples.batch
    old = calls.policy.compute_log_prob(batch, calculate_entropy=True)
    values = calls.compute_values(batch)
    if old is None or values is None:
        raise RuntimeError("drivetrain ppo needs log-probs and values on every data-parallel rank.")
    batch["old_log_probs"], batch["values"] = old["log_probs"], values["values"]
    if calls.policy.compute_ref_log_prob is not None:
        batch["ref_log_prob"] = calls.policy.compute_ref_log_prob(batch)["ref_log_prob"]  # type: ignore[index]
    statistics = RolloutStatistics.measure(batch, old, samples.rollout_log_probs)
    metrics = estimate_advantages(batch, samples.rewards, algorithm, kl_coef, group)
    metrics.update({CRITIC_PREFIX + k: v for k, v in calls.update_critic(batch).items()})
    if train_actor:
        metrics.update(calls.policy.update_policy(batch))
    return metrics, statistics


def update(
    actor: Actor,
    reference: Reference | None,
    critic: Critic,
    samples: RolloutBatch,
    algorithm: AlgorithmConfig,
    kl_coef: float,
    *,
    train_actor: bool,
) -> dict[str, float]:
    """:func:`update_with` on this process's roles; the statistics reduced over the data-parallel ranks."""
    calls = PPOCalls(
        policy=policy_calls(actor, reference),
        compute_values=critic.compute_values,
        update_critic=critic.update_critic,
    )
    group = actor.engine.data_parallel_group
    metrics, statistics = update_with(
        calls, samples, algorithm, kl_coef, train_actor=train_actor, group=group
    )
    return {**metrics, **statistics.reduced(group).metrics()}
