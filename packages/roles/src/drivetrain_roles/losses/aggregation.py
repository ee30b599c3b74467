"""Per-token tensors to one scalar, normalised by the *global* mini-batch counts.

Every loss of this package is a sum over tokens (or sequences) of the micro-batch divided by a count of the
whole mini-batch over every data-parallel rank (:class:`~drivetrain_engine_core.job.LossContext`). Summing
the micro-batch results therefore gives the mini-batch loss exactly, whatever the micro-batching, dynamic
batching or data-parallel size, and so does the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.job import LossContext

from .names import AGGREGATION_MODES as AGGREGATION_MODES  # importable from here since 0.1.0
from .names import CONSTANT_LENGTH_MODE, check_aggregation_mode
from .names import POLICY_AGGREGATION_MODES as POLICY_AGGREGATION_MODES  # importable from here since 0.1.0


@dataclass(frozen=True)
class FlatTokens:
    """The flat view of jagged per-token tensors that share one layout.

    Attributes:
        mask: float ``(total_tokens,)`` loss mask (1 where the token is trained on).
        offsets: ``(num_sequences + 1,)`` start of each sequence in the flat tensors.
    """

    mask: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_jagged(cls, loss_mask: torch.Tensor) -> FlatTokens:
        """Read the layout from a jagged ``loss_mask`` (ragged dim 1, ARCHITECTURE §4)."""
        return cls(mask=loss_mask.values().float(), offsets=loss_mask.offsets())  # type: ignore[attr-defined]

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` on loss tokens, 0 elsewhere, whatever is stored elsewhere.

        NOTE: masks select, they never multiply. Prompt and padding positions may hold NaN or inf (an unset
        ``old_log_probs``, an infinite advantage); ``x * 0`` is NaN there, and so is the gradient that flows
        through any term computed from it. Loss functions select their batch inputs with this before
        computing anything, and :func:`aggregate` selects its values again.
        """
        selected = self.mask.to(values.device) != 0
        return torch.where(selected, values, torch.zeros((), dtype=values.dtype, device=values.device))

    def weighted(self, values: torch.Tensor) -> torch.Tensor:
        """``values * mask`` on loss tokens, 0 elsewhere (see :meth:`select`)."""
        return self.select(values) * self.mask.to(device=values.device, dtype=values.dtype)

    @property
    def num_sequences(self) -> int:
        return int(self.offsets.numel() - 1)

    def sequence_ids(self) -> torch.Tensor:
        """``(total_tokens,)`` index of the sequence each token belongs to (its size given: without it,
        ``repeat_interleave`` reads the lengths back from the device, a wait after every micro-batch's loss)."""
        lengths = self.offsets.diff()
        sequences = torch.arange(self.num_sequences, device=lengths.device)
        return torch.repeat_interleave(sequences, lengths, output_size=self.mask.numel())

    def per_sequence_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``(num_sequences,)`` masked sum of ``values`` within each sequence (differentiable)."""
        sums = torch.zeros(self.num_sequences, dtype=values.dtype, device=values.device)
        return sums.index_add(0, self.sequence_ids().to(values.device), self.weighted(values))


def flat_values(tensor: torch.Tensor) -> torch.Tensor:
    """The flat ``(total_tokens, ...)`` values of a jagged tensor; dense tensors pass through."""
    return tensor.values() if tensor.is_nested else tensor


def aggregate(
    values: torch.Tensor,
    tokens: FlatTokens,
    context: LossContext,
    mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the mini-batch aggregate of per-token ``values``.

    Args:
        values: flat ``(total_tokens,)`` per-token values.
        tokens: the micro-batch's mask and sequence layout.
        context: the global counts.
        mode: ``token-mean`` (masked sum / global loss tokens), ``seq-mean-token-sum`` (per-sequence masked
            sums, summed and divided by the global sequence count), ``seq-mean-token-mean`` (per-sequence
            masked means, likewise; a sequence without loss tokens counts as 0), ``seq-mean-token-sum-norm``
            (masked sum / (global sequences x ``loss_scale_factor``): Dr. GRPO's constant length) or
            ``token-sum`` (masked sum, not normalised).
        loss_scale_factor: the constant length of ``seq-mean-token-sum-norm``; not read by the other modes.

    Returns:
        A scalar; the sum over every micro-batch on every rank is the mini-batch aggregate.
    """
    check_aggregation_mode(mode, loss_scale_factor)
    if mode in ("token-mean", "token-sum", CONSTANT_LENGTH_MODE):
        total = tokens.weighted(values).sum()
        if mode == "token-sum":
            return total
        if mode == "token-mean":
            return total / max(context.global_token_count, 1)
        return total / (max(context.global_sequence_count, 1) * float(loss_scale_factor))  # type: ignore[arg-type]
    per_sequence = tokens.per_sequence_sum(values)
    if mode == "seq-mean-token-mean":
        counts = tokens.per_sequence_sum(torch.ones_like(values)).clamp(min=1.0)
        per_sequence = per_sequence / counts
    return per_sequence.sum() / max(context.global_sequence_count, 1)


def masked_fraction(condition: torch.Tensor, tokens: FlatTokens, context: LossContext) -> torch.Tensor:
    """Contribution of this micro-batch to the global fraction of loss tokens where ``condition`` holds (a
    detached scalar on the device: the engine reads every metric of a step in one transfer)."""
    return aggregate(condition.detach().float(), tokens, context, "token-mean")
