"""A step's metrics, built in one place for every RL command and controller.

The trainers' record (:class:`StepRecord`) reduces what it needs over the data-parallel group in one
all-reduce and names the update's metrics once (``pg_loss`` -> ``train/pg_loss``, ...); a command adds only what
is its own (GRPO's timing and staleness, PPO's critic). The single controllers' record
(:func:`controller_record`) is the update's metrics as the workers return them, with the rewards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from drivetrain_engine_core.kit import distributed
from torch.distributed import ProcessGroup

from .batch import RolloutBatch
from .rewards import reward_metrics

ACTOR_METRICS = {
    "pg_loss": "train/pg_loss",
    "pg_clipfrac": "train/clip_fraction",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "rollout_is_weight": "train/rollout_is_weight",
    "rollout_is_capped": "train/rollout_is_capped",
}
"""The actor's update metrics in a step's record, each when the update reports it (none while it is frozen)."""

ROLLOUT_METRICS = ("rollout/log_prob_diff_max", "rollout/mismatch_kl")
"""What the old-log-prob pass says about the rollout (:class:`.policy_update.RolloutStatistics`)."""


@dataclass(frozen=True)
class SampleTotals:
    """A step's samples summed over the data-parallel group.

    Attributes:
        reward_sum: the responses' rewards.
        count: responses.
        response_tokens: tokens of the responses.
        tokens: tokens of the prompt+response sequences.
        filtered_groups: groups ``algorithm.filter_groups`` took out of the loss.
    """

    reward_sum: float
    count: float
    response_tokens: float
    tokens: float
    filtered_groups: float

    @classmethod
    def reduce(cls, samples: RolloutBatch, group: ProcessGroup | None) -> SampleTotals:
        """The totals over ``group``'s ranks (collective: one all-reduce)."""
        values = distributed.all_reduce_sums(
            [
                float(samples.rewards.sum()),
                len(samples.rewards),
                sum(samples.response_lengths),
                int(samples.batch["input_ids"].values().numel()),
                samples.filtered_groups,
            ],
            group,
        )
        return cls(*values)


@dataclass(frozen=True)
class StepRecord:
    """One trainer step's shared measurements.

    Attributes:
        totals: the samples over the data-parallel group.
        rewards: each reward function's ``reward/<name>`` (and ``reward/<name>/failed``).
        update: the update's metrics (the actor's, ``entropy``, the rollout statistics, a command's own).
        seconds: the step's wall time.
    """

    totals: SampleTotals
    rewards: Mapping[str, float]
    update: Mapping[str, float]
    seconds: float

    @classmethod
    def measure(
        cls, samples: RolloutBatch, update: Mapping[str, float], *, seconds: float, group: ProcessGroup | None
    ) -> StepRecord:
        """The record of a step that trained on ``samples`` (collective over ``group``: the totals, then each
        reward function's mean)."""
        totals = SampleTotals.reduce(samples, group)
        return cls(
            totals=totals, rewards=reward_metrics(samples.scores, group), update=update, seconds=seconds
        )

    @property
    def mean_reward(self) -> float:
        return self.totals.reward_sum / self.totals.count

    def values(self) -> dict[str, float]:
        """``train/reward``, ``reward/<name>``, the actor's metrics, ``train/entropy``,
        ``train/response_length``, the rollout statistics, ``perf/step_time_s``, ``perf/tokens_per_s`` and
        ``train/kl`` (the KL in the reward, else the KL loss; absent without either)."""
        update, totals = self.update, self.totals
        values = {
            "train/reward": self.mean_reward,
            **self.rewards,
            **{name: update[key] for key, name in ACTOR_METRICS.items() if key in update},
            "train/entropy": update["entropy"],
            "train/response_length": totals.response_tokens / totals.count,
            **{name: update[name] for name in ROLLOUT_METRICS},
            "perf/step_time_s": self.seconds,
            "perf/tokens_per_s": totals.tokens / self.seconds,
        }
        kl = update.get("kl", update.get("kl_loss"))
        if kl is not None:
            values["train/kl"] = kl
        return values


def controller_record(samples: RolloutBatch, update: Mapping[str, float]) -> dict[str, float]:
    """A single controller's step: the update's metrics as its workers return them, each reward function's
    ``reward/<name>`` and the mean ``train/reward`` (the driver holds every response)."""
    return {**update, **reward_metrics(samples.scores), "train/reward": float(samples.rewards.mean())}


__all__ = ["ACTOR_METRICS", "ROLLOUT_METRICS", "SampleTotals", "StepRecord", "controller_record"]
