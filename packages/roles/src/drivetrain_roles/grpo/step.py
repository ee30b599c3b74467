"""One GRPO step over any engine and any rollout: sample, score, normalise, update, hand the weights off.

Per step, on every data-parallel rank for its share of the prompts: the rollout samples ``n`` responses per
prompt (whole groups stay on one rank, so group baselines need no communication); the rewards
(``algorithm.reward_functions``, weighted: :mod:`.rewards`), shaped as DAPO's options say, become
advantages by ``algorithm.adv_estimator`` (the whitening ones reduce over the data-parallel group); the actor
recomputes the old log-probs and the reference its log-probs; one policy update (``algorithm.loss_mode``);
then ``engine.weight_buckets(version=step, base_version=rollout.delta_base)`` streams what changed to the
rollout, which serves only complete, newer versions on the base it holds intact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core import distributed
from drivetrain_engine_core.agreement import agreed_checks
from drivetrain_engine_core.data.batch import make_batch
from drivetrain_engine_core.handoff import LoraMode
from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig
from drivetrain_engine_core.router_replay import ROUTED_EXPERTS
from tensordict import TensorDict
from torch.distributed import ProcessGroup

from ..actor import Actor
from ..advantage_estimators import outcome_advantages
from ..jobs.data import Example
from ..reference import Reference
from ..reward_shaping import equal_reward_groups, overlong_penalty
from .config import GRPOConfig, RolloutJobConfig
from .reward_inputs import RewardInputs
from .reward_settings import RewardSettings
from .rewards import Scores, score_completions
from .versions import Versions

SEED_STRIDE = 1_000_003
"""Sampling seeds are ``seed + SEED_STRIDE * step + rank``: distinct per step and rank, repeatable on resume."""


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


def sampling_config(config: RolloutJobConfig, *, seed: int) -> SamplingConfig:
    """The step's sampling: ``rollout.n`` responses per prompt at the rollout's temperature, truncated by its
    ``top_k``/``top_p``/``min_p``, recording routed experts under ``rollout.router_replay=R3``."""
    sampling = config.rollout.sampling(seed=seed)
    return dataclasses.replace(sampling, record_routed_experts=config.rollout.records_routes)


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
    return score_agreed(examples, output, tokenizer, config, group)


def score_agreed(
    examples: Sequence[Example],
    output: RolloutOutput,
    tokenizer: Any,
    config: GRPOConfig,
    group: ProcessGroup | None = None,
    *,
    versions: Versions | None = None,
) -> RolloutBatch:
    """:func:`score` on every data-parallel rank at once (collective: a reward function failing on one rank
    raises the same error on every rank)."""
    with agreed_checks():
        _, scores = answer_rewards(examples, output, tokenizer, config.algorithm.rewards())
    return rollout_batch(examples, output, scores.total, config, group, versions=versions, scores=scores)


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
    """The actor's batch from the rewards (``scores``: each function's, carried for the metrics): the overlong penalty, the group filter and the groups too stale for
    ``versions`` leave the loss, then the advantages. The batch carries each token's weight version
    (``token_versions``), the rollout's log-probs (``rollout_log_probs``, 0 on prompt tokens) and, under router
    replay, its routed experts (``routed_experts``)."""
    algorithm = config.algorithm
    lengths = [len(r) for r in output.responses]
    rewards = rewards + overlong_penalty(
        torch.tensor(lengths),
        config.rollout.max_new_tokens,
        algorithm.overlong_buffer_len,
        algorithm.overlong_penalty_factor,
    )
    filtered = equal_reward_groups(rewards, output.n)
    if not algorithm.filter_groups:
        filtered = torch.zeros_like(filtered)
    if versions is None:
        version = output.version or 0
        versions = Versions.of(output, version, current=version, max_staleness=None)
    stale = versions.stale_groups(output.n)
    batch, responses = response_batch(examples, output, keep=~(filtered | stale).repeat_interleave(output.n))
    prompt_lengths = batch["input_ids"].offsets().diff() - torch.tensor(lengths, dtype=torch.long)
    batch["token_versions"] = _jagged(versions.token_field(prompt_lengths.tolist()), batch)
    rollout_log_probs = torch.zeros(batch["input_ids"].values().numel())
    if output.log_probs:
        rollout_log_probs[responses] = torch.cat(list(output.log_probs)).float()
    batch["rollout_log_probs"] = _jagged([rollout_log_probs], batch)
    if output.routed_experts is not None:  # router replay: the actor routes through the rollout's experts
        batch[ROUTED_EXPERTS] = _jagged(output.routed_experts, batch)
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


def _jagged(rows: Sequence[torch.Tensor], batch: TensorDict) -> torch.Tensor:
    """Per-token ``rows`` as a jagged field on ``batch``'s offsets."""
    return torch.nested.nested_tensor_from_jagged(torch.cat(list(rows)), offsets=batch["input_ids"].offsets())


def answer_rewards(
    examples: Sequence[Example], output: RolloutOutput, tokenizer: Any, rewards: RewardSettings
) -> tuple[list[str], Scores]:
    """The decoded answers of ``output`` (``output.n`` per example, prompt-major) and their scores by
    ``rewards`` (``algorithm.rewards()``), each answer with its example's prompt, reference and columns."""
    ids = [r.tolist() for r in output.responses]
    answers = [tokenizer.decode(r, skip_special_tokens=True) for r in ids]
    return answers, score_completions(rewards, RewardInputs.of(examples, answers, ids))


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


def update(actor: Actor, reference: Reference | None, samples: RolloutBatch) -> dict[str, float]:
    """Old and reference log-probs, then one PPO-clip update; returns the actor's update metrics.

    Besides the actor's update metrics: ``entropy``, the token-mean entropy of the policy over the step's
    response tokens before the update (from the old-log-prob pass, as verl reports it, so that the update
    itself computes no entropy unless the loss has an entropy bonus), and ``rollout/log_prob_diff_max``, the
    largest gap between the rollout's log-probs and the actor's recomputation of them: a weight hand-off that
    served stale or partial weights shows up there. Both cover every data-parallel rank's rows.
    """
    calls = PolicyCalls(
        compute_log_prob=actor.compute_log_prob,
        compute_ref_log_prob=None if reference is None else reference.compute_ref_log_prob,
        update_policy=actor.update_policy,
    )
    metrics, statistics = update_with(calls, samples)
    return {**metrics, **statistics.reduced(actor.engine.data_parallel_group).metrics()}


@dataclass(frozen=True)
class PolicyCalls:
    """Where the update's three calls go: this process's roles, or a worker group's parts.

    Attributes:
        compute_log_prob: the actor's per-token ``log_probs`` of a batch (and ``entropy`` when called with
            ``calculate_entropy=True``).
        compute_ref_log_prob: the reference's ``ref_log_prob`` (``None``: no KL penalty).
        update_policy: one actor update; returns its metrics.
    """

    compute_log_prob: Callable[..., TensorDict | None]
    compute_ref_log_prob: Callable[[TensorDict], TensorDict | None] | None
    update_policy: Callable[[TensorDict], dict[str, float]]


@dataclass(frozen=True)
class RolloutStatistics:
    """What the actor's old-log-prob pass says about a step's responses, as host numbers summed over ranks.

    Attributes:
        log_prob_gap: the largest gap between the actor's and the rollout's log-probs of a response token.
        mismatch_kl_sum: :func:`k3_sum` of the response tokens.
        entropy_sum: the policy's entropy summed over the response tokens.
        response_tokens: how many response tokens.
    """

    log_prob_gap: float
    mismatch_kl_sum: float
    entropy_sum: float
    response_tokens: int

    @classmethod
    def measure(
        cls, batch: TensorDict, old: TensorDict, rollout_log_probs: list[torch.Tensor]
    ) -> RolloutStatistics:
        """The statistics of the rows held here; one host read of the entropy."""
        mask = batch["loss_mask"].values()
        log_ratios = response_log_ratios(batch, old["log_probs"], rollout_log_probs)
        return cls(
            log_prob_gap=largest_gap(log_ratios),
            mismatch_kl_sum=k3_sum(log_ratios),
            entropy_sum=float(old["entropy"].values()[mask].sum()),
            response_tokens=int(mask.sum()),
        )

    def reduced(self, group: Any) -> RolloutStatistics:
        """The statistics over every rank of ``group`` (collective)."""
        mismatch_kl_sum, entropy_sum, response_tokens = distributed.all_reduce_sums(
            [self.mismatch_kl_sum, self.entropy_sum, self.response_tokens], group
        )
        return RolloutStatistics(
            log_prob_gap=distributed.all_reduce_max(self.log_prob_gap, group),
            mismatch_kl_sum=mismatch_kl_sum,
            entropy_sum=entropy_sum,
            response_tokens=int(response_tokens),
        )

    def metrics(self) -> dict[str, float]:
        """``entropy`` and ``rollout/mismatch_kl`` (token means) and ``rollout/log_prob_diff_max``."""
        tokens = max(self.response_tokens, 1)
        return {
            "entropy": self.entropy_sum / tokens,
            "rollout/log_prob_diff_max": self.log_prob_gap,
            "rollout/mismatch_kl": self.mismatch_kl_sum / tokens,
        }


def update_with(calls: PolicyCalls, samples: RolloutBatch) -> tuple[dict[str, float], RolloutStatistics]:
    """The update of :func:`update` through ``calls``: the actor's update metrics, and the statistics of the
    rows the caller holds (the single-process trainer reduces them over data-parallel ranks, a worker group's
    driver holds them all)."""
    batch = samples.batch
    old = calls.compute_log_prob(batch, calculate_entropy=True)
    if old is None:
        raise RuntimeError(
            "drivetrain grpo needs log-probs on every data-parallel rank (an output rank each)."
        )
    batch["old_log_probs"] = old["log_probs"]
    if calls.compute_ref_log_prob is not None:
        batch["ref_log_prob"] = calls.compute_ref_log_prob(batch)["ref_log_prob"]  # type: ignore[index]
    statistics = RolloutStatistics.measure(batch, old, samples.rollout_log_probs)
    return calls.update_policy(batch), statistics


def response_log_ratios(
    batch: TensorDict, actor_log_probs: torch.Tensor, rollout_log_probs: list[torch.Tensor]
) -> torch.Tensor:
    """``log pi_actor - log pi_rollout`` of every response token in the loss, concatenated, in float64 (exact
    differences of the float32 inputs); empty when no response has a token (a third-party rollout may return
    empty ones).

    The responses of groups out of the loss (``algorithm.filter_groups``, too stale) have no loss token and
    are left out, as they are of the entropy and the token count beside these ratios.
    """
    mask = batch["loss_mask"]
    flat_mask = mask.values()
    loss_tokens = torch.cat([flat_mask.new_zeros(1, dtype=torch.long), flat_mask.long().cumsum(0)])
    in_loss = (loss_tokens[mask.offsets()].diff() > 0).tolist()
    actor = actor_log_probs.values()[flat_mask].double()
    rolled = [r for r, kept in zip(rollout_log_probs, in_loss, strict=True) if kept]
    if not rolled:
        return actor.new_zeros(0)
    return actor - torch.cat(rolled).to(actor.device).double()


def largest_gap(log_ratios: torch.Tensor) -> float:
    """The largest ``|log pi_actor - log pi_rollout|`` of :func:`response_log_ratios` (0 over no tokens)."""
    return float(log_ratios.abs().max()) if log_ratios.numel() else 0.0


def k3_sum(log_ratios: torch.Tensor) -> float:
    """``KL(pi_rollout || pi_actor)`` estimated on the sampled response tokens and summed: ``r - 1 - log r`` with
    ``r = pi_actor / pi_rollout`` per token (the k3 estimator: unbiased under the rollout's sampling, never
    negative). The training-inference mismatch that truncated importance sampling corrects; 0 when the rollout
    serves exactly the actor's weights."""
    return float((log_ratios.exp() - 1 - log_ratios).sum())


def log_prob_gap(
    batch: TensorDict, actor_log_probs: torch.Tensor, rollout_log_probs: list[torch.Tensor]
) -> float:
    """The largest gap between the actor's and the rollout's log-probs of the batch's response tokens."""
    return largest_gap(response_log_ratios(batch, actor_log_probs, rollout_log_probs))


def mismatch_kl_sum(
    batch: TensorDict, actor_log_probs: torch.Tensor, rollout_log_probs: list[torch.Tensor]
) -> float:
    """:func:`k3_sum` of the batch's response tokens."""
    return k3_sum(response_log_ratios(batch, actor_log_probs, rollout_log_probs))


def hand_off(
    actor: Actor, rollout: Rollout, version: int, bucket_mb: float, lora: LoraMode = "merged"
) -> dict[str, float]:
    """Stream the actor's weights (``lora``: merged, or its adapters alone) to the rollout as ``version``
    (collective over the actor's ranks): a delta on the version the rollout serves intact, else in full. Returns
    the sync's metrics (``rollout/sync_bytes``, ...)."""
    buckets = actor.engine.weight_buckets(
        version=version, bucket_bytes=int(bucket_mb * 2**20), base_version=rollout.delta_base, lora=lora
    )
    rollout.update_weights(buckets)
    return rollout.last_sync.as_metrics() if rollout.last_sync is not None else {}
