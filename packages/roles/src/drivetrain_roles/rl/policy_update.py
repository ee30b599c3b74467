"""The policy's side of an RL update, shared by ``grpo`` and ``ppo``: the actor's old log-probs (with the
entropy), the reference's log-probs, the policy update, and what the old-log-prob pass says about the rollout
(the log-prob gap and the mismatch KL between the rollout's sampling and the actor's recomputation).

The calls go through :class:`PolicyCalls`, so that the single-process trainers (this process's roles) and the
single controllers (a worker group's parts) run the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core.kit import distributed
from tensordict import TensorDict

from ..actor import Actor
from ..reference import Reference
from .batch import RolloutBatch


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


def policy_calls(actor: Actor, reference: Reference | None) -> PolicyCalls:
    """The calls of this process's roles: the actor's log-probs and update, the reference's log-probs (``None``:
    no KL term reads them)."""
    return PolicyCalls(
        compute_log_prob=actor.compute_log_prob,
        compute_ref_log_prob=None if reference is None else reference.compute_ref_log_prob,
        update_policy=actor.update_policy,
    )


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
    """Old and reference log-probs, then one policy update, through ``calls``: the actor's update metrics, and
    the statistics of the rows the caller holds (the single-process trainer reduces them over data-parallel
    ranks, a worker group's driver holds them all)."""
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
