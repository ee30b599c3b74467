"""Checks of a batch's values (not only its structure) against the model: token ids in the vocabulary,
sequences within the model's positions, well-formed offsets, finite float fields.

All the numbers are reduced on the batch's device and fetched with one host transfer per batch (not per
micro-batch): an id outside the vocabulary would otherwise surface as a raw ``IndexError``, a CUDA device
assert, or, with a padded vocabulary (Megatron), be trained on silently with an infinite loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from .._errors import BatchError
from .batch import FLOAT_FIELDS, INPUT_IDS, LOSS_MASK, field_names, is_jagged, offsets_of


@dataclass(kw_only=True, frozen=True)
class TokenLimits:
    """What the model accepts; ``None`` skips that check.

    Attributes:
        vocab_size: token ids must lie in ``[0, vocab_size)`` (the tokenizer's vocabulary, not a padded one).
        max_positions: the longest sequence the model's position embeddings cover.
        model: how to name the model in messages (its path).
    """

    vocab_size: int | None = None
    max_positions: int | None = None
    model: str = "the model"

    @classmethod
    def from_hf_config(cls, hf_config: Any, model: str) -> TokenLimits:
        """The limits of a Hugging Face config (``vocab_size``, ``max_position_embeddings``), read by name."""
        return cls(
            vocab_size=getattr(hf_config, "vocab_size", None),
            max_positions=getattr(hf_config, "max_position_embeddings", None),
            model=model,
        )


def check_batch_values(batch: TensorDict, limits: TokenLimits) -> None:
    """Check offsets, token ids, sequence lengths and float fields of ``batch`` (one host sync).

    Raises:
        BatchError: naming the field, the first sequence at fault and the fix.
    """
    ids = batch[INPUT_IDS]
    offsets = offsets_of(ids)
    values = ids.values()
    lengths = offsets.diff()
    floats = _float_fields(batch)
    stats = [
        offsets[0],
        offsets[-1] - values.shape[0],
        lengths.min(),
        lengths.max(),
        values.min() if values.numel() else offsets[0],
        values.max() if values.numel() else offsets[0],
        *[(~torch.isfinite(batch[key].values())).sum() for key in floats],
    ]
    first, surplus, shortest, longest, low, high, *non_finite = torch.stack(
        [s.to(torch.float64) for s in stats]
    ).tolist()
    if first != 0 or surplus != 0 or shortest < 0:
        raise BatchError(
            f"input_ids has malformed offsets {offsets.tolist()[:12]} for {values.shape[0]} tokens: they must "
            "start at 0, never decrease and end at the token count; build batches with make_batch."
        )
    if limits.vocab_size is not None and (low < 0 or high >= limits.vocab_size):
        bad = int(low) if low < 0 else int(high)
        raise BatchError(
            f"input_ids of sequence {_sequence_of(values == bad, offsets)} holds token id {bad}, outside "
            f"[0, {limits.vocab_size}) of {limits.model}: the data was tokenized with another tokenizer, or "
            "model.path names another model. Tokenize with the model's own tokenizer."
        )
    if limits.max_positions is not None and longest > limits.max_positions:
        raise BatchError(
            f"sequence {int(lengths.argmax())} has {int(longest)} tokens, more than the "
            f"{limits.max_positions} positions of {limits.model} (max_position_embeddings): truncate or drop it."
        )
    for key, count in zip(floats, non_finite, strict=True):
        if count:
            flags = ~torch.isfinite(batch[key].values())
            raise BatchError(
                f"{key} of sequence {_sequence_of(flags, offsets)} holds {int(count)} non-finite value(s) "
                "(NaN or inf) in the batch; fix the values that produced it."
            )


def _float_fields(batch: TensorDict) -> list[str]:
    names = field_names(batch)
    keys = [k for k in (*FLOAT_FIELDS, LOSS_MASK) if k in names and is_jagged(batch.get(k))]
    return [k for k in keys if batch[k].dtype.is_floating_point]


def _sequence_of(flags: Tensor, offsets: Tensor) -> int:
    """Index of the sequence holding the first flagged token (error path only)."""
    token = int(flags.nonzero()[0, 0])
    return int(torch.searchsorted(offsets, torch.tensor(token, device=offsets.device), right=True)) - 1
