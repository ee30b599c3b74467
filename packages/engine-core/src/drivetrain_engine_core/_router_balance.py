"""The router's load-balancing (auxiliary) loss of a mixture-of-experts model, as part of the loss contract.

Shared by the backends (FSDP takes the router logits from transformers, Megatron from its routers), so both
add the same term. The formula is transformers' ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6),
applied to each sequence on its own: over the ``n`` (layer, token) rows of one sequence, with ``E`` experts and
top-``k`` routing,

    aux(s) = E * sum_e (c_e / n) * (P_e / n)

where ``c_e`` counts the rows that route to expert ``e`` among their top ``k`` and ``P_e`` sums the router's
softmax probability of ``e``. The step's value is the mean over the global batch's sequences, added to the loss
times the coefficient:

    loss = loss_fn(...) + coef * (1 / S) * sum_s aux(s)

NOTE: why per sequence. transformers applies the formula to whatever batch one forward sees (padding masked),
so its value depends on how sequences are grouped: a different micro-batch size or rank count gave a different
loss and gradient (the normalisation bug verl #6836 reports under context parallelism). Each sequence's term is
computed inside its own micro-batch and divided by the global sequence count (``LossContext.global_sequence_count``),
so the sum over micro-batches and ranks is the same for any split and equals what plain transformers gives for
each sequence run alone (a batch of one), averaged. DeepSeek-V3's "sequence-wise balance loss" is this
normalisation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._config import ConfigError
from ._outputs import MicroBatchResult
from ._round_trip import MicroBatch

ROUTER_AUX_METRIC = "router_aux_loss"
"""Metric of each micro-batch's share of the (unscaled) load-balancing loss; they sum to the step's value."""


@dataclass(frozen=True)
class RouterLoss:
    """The balance loss of a routed model: its weight in the loss (0: reported only) and the model's top-k."""

    coefficient: float
    top_k: int

    @staticmethod
    def applies(micro_batch: MicroBatch) -> bool:
        """Whether the micro-batch computes it: a call with a loss function, on a micro-batch of sequences."""
        return micro_batch.round_trip.loss_fn is not None and not micro_batch.filler

    def add(
        self,
        loss: torch.Tensor,
        result: MicroBatchResult,
        router_logits: Sequence[torch.Tensor],
        micro_batch: MicroBatch,
    ) -> tuple[torch.Tensor, MicroBatchResult]:
        """``MicroBatch.finish``'s loss and result with this micro-batch's share of the balance loss added.

        The share is ``sum_s aux(s) / global_sequence_count``; the loss to backpropagate gets ``coefficient``
        times it, scaled by the gradient divisor as ``finish`` scales the caller's loss; the result's loss gets
        it unscaled, and its metrics :data:`ROUTER_AUX_METRIC` (the share itself, without the coefficient).

        Args:
            router_logits: per routed layer, the router's logits ``(rows x width, E)`` in the layout of the
                micro-batch's ``input_ids`` (a packed row, or padded rows with their padding).
        """
        shares = sequence_losses(router_logits, micro_batch, self.top_k)
        share = shares.sum() / micro_batch.context.global_sequence_count
        weighted = self.coefficient * share
        if result.loss is None:
            raise ValueError("the router balance loss is added to a micro-batch result that has no loss")
        reported = dataclasses.replace(
            result,
            loss=result.loss + weighted.detach(),
            metrics={**result.metrics, ROUTER_AUX_METRIC: share.detach()},
        )
        return loss + weighted * micro_batch.round_trip.gradient_divisor, reported


def router_loss_of(requested: float | None, hf_config: Any, model_type: str) -> RouterLoss | None:
    """The balance loss of the model ``hf_config`` describes; ``None`` for a model without a router, or a value
    model (its head gets no router logits).

    ``requested=None`` (``engine.router_aux_loss_coef`` unset) follows the model's config as transformers' own
    training does: its ``router_aux_loss_coef`` when its ``output_router_logits`` is true, else 0 (off, still
    reported).

    Raises:
        ConfigError: a positive coefficient for a model without a router.
    """
    routed = hasattr(hf_config, "output_router_logits") and hasattr(hf_config, "num_experts_per_tok")
    if not routed or model_type != "language_model":
        if requested:
            raise ConfigError(
                f"engine.router_aux_loss_coef={requested} asks for a router load-balancing loss, but "
                f"{type(hf_config).__name__} as a {model_type} has no router logits to take it from (a dense model, "
                "or a value model's head). drivetrain trains it for mixture-of-experts language models; leave "
                "router_aux_loss_coef unset here."
            )
        return None
    if requested is None:
        requested = float(hf_config.router_aux_loss_coef) if hf_config.output_router_logits else 0.0
    return RouterLoss(coefficient=requested, top_k=int(hf_config.num_experts_per_tok))


def sequence_losses(
    router_logits: Sequence[torch.Tensor], micro_batch: MicroBatch, top_k: int
) -> torch.Tensor:
    """``aux(s)`` of every sequence of ``micro_batch`` (``(S,)``, float32, differentiable).

    Args:
        router_logits: per routed layer, the router's logits ``(rows x width, E)`` in the layout of the
            micro-batch's ``input_ids``.
        micro_batch: the micro-batch they were computed for (its layout maps them to tokens).
        top_k: experts per token (the config's ``num_experts_per_tok``).
    """
    inputs = micro_batch.inputs
    lengths = inputs.offsets.diff()
    # output_size from the host count: no read-back of the lengths from the device.
    sequence_of = torch.repeat_interleave(
        torch.arange(len(lengths), device=lengths.device), lengths, output_size=micro_batch.num_tokens
    )
    experts = router_logits[0].shape[-1]
    counts = lengths.new_zeros(len(lengths), experts, dtype=torch.float32)
    probs = lengths.new_zeros(len(lengths), experts, dtype=torch.float32)
    for layer in router_logits:
        token_logits = micro_batch.rows(layer.view(*inputs.input_ids.shape, experts)).float()
        weights = torch.softmax(token_logits, dim=-1)
        chosen = torch.nn.functional.one_hot(weights.topk(top_k, dim=-1).indices, experts).sum(1)
        counts = counts.index_add(0, sequence_of, chosen.float())
        probs = probs.index_add(0, sequence_of, weights)
    rows = (lengths * len(router_logits)).float().unsqueeze(-1)
    return experts * ((counts / rows) * (probs / rows)).sum(-1)
