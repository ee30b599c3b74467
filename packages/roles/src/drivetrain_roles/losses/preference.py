"""Pairwise preference losses: DPO (sigmoid), IPO and their reference-free variants; Bradley-Terry for reward models.

A preference batch holds the chosen and the rejected response of each prompt as two sequences sharing a
``uid``, with a dense per-sequence bool ``chosen``; core's group-aware micro-batching keeps both in one
micro-batch (:func:`drivetrain_engine_core.job.sequence_groups`). Each pair contributes ``loss / global_pairs``, where
``global_pairs = LossContext.global_sequence_count / 2``, so the sum over micro-batches and ranks is the mean
over every pair of the mini-batch, whatever the micro-batching or data-parallel size. Metrics are
contributions that sum to mini-batch means too, under the names TRL uses (``rewards/chosen``, ...).

References: DPO, Rafailov et al. 2023 (``-log sigmoid(beta * (log-ratio chosen - log-ratio rejected))``);
IPO, Azar et al. 2023 (``(log-ratio chosen - log-ratio rejected - 1 / (2 beta))^2``), on per-token mean
log-probs as TRL computes it (with sums the target margin ``1 / (2 beta)`` is in total nats, so a beta tuned
in TRL would not transfer and the loss would grow with the response length); Bradley-Terry reward models,
Ouyang et al. 2022 (``-log sigmoid(r_chosen - r_rejected)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import UID, LossContext, LossFn, sequence_groups
from tensordict import TensorDict

from .aggregation import FlatTokens, flat_values
from .config import DPO_LOSS_TYPES as DPO_LOSS_TYPES  # importable from here since 0.1.0
from .config import DPOLossConfig as DPOLossConfig  # importable from here since 0.1.0
from .config import RewardLossConfig as RewardLossConfig  # importable from here since 0.1.0

CHOSEN = "chosen"
"""Dense per-sequence bool field: true for the chosen response of a pair."""
REF_LOGP = "ref_logp"
"""Dense per-sequence float field: the reference model's summed log-prob of the sequence's loss tokens."""
MARGIN = "margin"
"""Optional dense per-sequence float field (both sides of a pair alike): by how much the chosen score should
exceed the rejected one (TRL's ``RewardTrainer`` margin)."""


def pair_indices(micro_batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of each pair's chosen and rejected sequence in ``micro_batch``, pairs in order of first member.

    Raises:
        BatchError: the batch has no ``uid``/``chosen`` fields, or a ``uid`` does not hold exactly one chosen
            and one rejected sequence.
    """
    names = list(map(str, micro_batch.keys()))
    if UID not in names or CHOSEN not in names:
        raise BatchError(
            f"a preference batch needs per-sequence '{UID}' (shared by a pair) and '{CHOSEN}' (bool) fields; it has "
            f"{sorted(names)}. Build it with drivetrain_roles.preference.batches.make_pair_batch."
        )
    chosen = micro_batch[CHOSEN].bool().tolist()
    groups = sequence_groups(micro_batch) or []
    if len(groups) * 2 != len(chosen) or any(len(g) != 2 or chosen[g[0]] == chosen[g[1]] for g in groups):
        raise BatchError(
            "a preference micro-batch must hold whole pairs: each uid exactly one chosen and one rejected "
            f"sequence; got uids {micro_batch.get(UID).tolist()} with chosen {chosen}."
        )
    winners = [g[0] if chosen[g[0]] else g[1] for g in groups]
    losers = [g[1] if chosen[g[0]] else g[0] for g in groups]
    return torch.tensor(winners), torch.tensor(losers)


def sequence_log_probs(model_output: TensorDict, micro_batch: TensorDict) -> torch.Tensor:
    """``(n,)`` summed log-prob of each sequence's loss-mask (response) tokens (masks select, never multiply)."""
    tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
    return tokens.per_sequence_sum(flat_values(model_output["log_probs"]))


def sequence_token_counts(micro_batch: TensorDict) -> torch.Tensor:
    """``(n,)`` loss-mask (response) tokens of each sequence, at least 1."""
    tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
    return tokens.per_sequence_sum(torch.ones_like(tokens.mask)).clamp(min=1.0)


def sequence_scores(model_output: TensorDict, micro_batch: TensorDict) -> torch.Tensor:
    """``(n,)`` reward of each sequence: its ``values`` at its loss-mask token (one per sequence)."""
    tokens = FlatTokens.from_jagged(micro_batch["loss_mask"])
    return tokens.per_sequence_sum(flat_values(model_output["values"]))


def dpo_terms(
    log_ratio_chosen: torch.Tensor, log_ratio_rejected: torch.Tensor, config: DPOLossConfig
) -> torch.Tensor:
    """Per-pair loss from the policy/reference log-ratios of the chosen and the rejected response."""
    difference = log_ratio_chosen - log_ratio_rejected
    if config.loss_type == "ipo":
        return (difference - 1.0 / (2.0 * config.beta)).square()
    return -F.logsigmoid(config.beta * difference)


def dpo_loss_fn(config: DPOLossConfig) -> LossFn:
    """A DPO/IPO loss for a language-model engine; the batch carries ``uid``, ``chosen`` and ``ref_logp``.

    Metrics (mini-batch means once summed): ``dpo_loss``, ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/margins``, ``rewards/accuracies`` (rewards are ``beta * log-ratio``), ``logps/chosen``,
    ``logps/rejected``.
    """

    def loss_fn(model_output: TensorDict, micro_batch: TensorDict, context: LossContext):
        winners, losers = pair_indices(micro_batch)
        policy = sequence_log_probs(model_output, micro_batch)
        reference = torch.zeros_like(policy)
        if not config.reference_free:
            reference = micro_batch[REF_LOGP].to(policy)
        if config.loss_type == "ipo":
            counts = sequence_token_counts(micro_batch).to(policy)
            policy, reference = policy / counts, reference / counts
        ratios = policy - reference
        per_pair = dpo_terms(ratios[winners], ratios[losers], config)
        pairs = max(context.global_sequence_count // 2, 1)
        loss = per_pair.sum() / pairs
        rewards_chosen = config.beta * ratios[winners].detach()
        rewards_rejected = config.beta * ratios[losers].detach()
        metrics = {
            "dpo_loss": loss.detach(),
            "rewards/chosen": rewards_chosen.sum() / pairs,
            "rewards/rejected": rewards_rejected.sum() / pairs,
            "rewards/margins": (rewards_chosen - rewards_rejected).sum() / pairs,
            "rewards/accuracies": (rewards_chosen > rewards_rejected).float().sum() / pairs,
            "logps/chosen": policy[winners].detach().sum() / pairs,
            "logps/rejected": policy[losers].detach().sum() / pairs,
        }
        return loss, metrics

    return loss_fn


def bradley_terry_loss_fn(config: RewardLossConfig | None = None) -> LossFn:
    """The Bradley-Terry loss of a reward (value-model) engine; the score is ``values`` at the loss-mask token:
    ``-log sigmoid(score_chosen - score_rejected - margin)`` per pair, the margin 0 unless the batch has one,
    plus ``center_rewards_coefficient * (score_chosen + score_rejected)^2`` when that is set.

    Metrics (mini-batch means once summed): ``rm_loss`` (the Bradley-Terry term), ``accuracy`` (chosen scored higher),
    ``margin``, ``scores/chosen``, ``scores/rejected``.
    """

    centring = (config or RewardLossConfig()).center_rewards_coefficient

    def loss_fn(model_output: TensorDict, micro_batch: TensorDict, context: LossContext):
        winners, losers = pair_indices(micro_batch)
        scores = sequence_scores(model_output, micro_batch)
        margin = scores[winners] - scores[losers]
        pairs = max(context.global_sequence_count // 2, 1)
        required = micro_batch[MARGIN][winners].to(margin) if MARGIN in micro_batch else 0.0
        loss = -F.logsigmoid(margin - required).sum() / pairs
        detached = margin.detach()
        metrics = {
            "rm_loss": loss.detach(),
            "accuracy": (detached > 0).float().sum() / pairs,
            "margin": detached.sum() / pairs,
            "scores/chosen": scores[winners].detach().sum() / pairs,
            "scores/rejected": scores[losers].detach().sum() / pairs,
        }
        if centring > 0:
            loss = loss + centring * (scores[winners] + scores[losers]).square().sum() / pairs
        return loss, metrics

    return loss_fn
