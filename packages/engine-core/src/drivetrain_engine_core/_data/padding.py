"""Exact conversions between left-right padded batches and the no-padding format.

Rollout engines produce verl-style padded batches: prompts left-padded to a common width, responses
right-padded to a common width, ``attention_mask`` marking real tokens. Every real token of row ``b`` sits at
column ``max_prompt_len - prompt_len[b] + k`` for its index ``k`` inside the sequence, so both directions are a
single gather/scatter with no per-row loop.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import Tensor

from .._errors import BatchError
from .batch import (
    INPUT_IDS,
    LOSS_MASK,
    LOSS_MASK_DTYPE,
    POSITION_IDS,
    as_loss_mask,
    jagged,
    token_keys,
    validate_batch,
)
from .jagged import offsets_of

ATTENTION_MASK = "attention_mask"
RESPONSE_MASK = "response_mask"


def padded_to_nopad(
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    position_ids: Tensor | None = None,
    response_mask: Tensor | None = None,
    **per_token_padded_fields: Tensor,
) -> TensorDict:
    """Drop the padding of a ``(B, L)`` batch and return a no-padding batch.

    Args:
        input_ids: ``(B, L)`` token ids.
        attention_mask: ``(B, L)``, non-zero at real tokens.
        position_ids: ``(B, L)`` or ``(B, L, extra...)``; defaults to ``cumsum(attention_mask) - 1``.
        response_mask: ``(B, L)``, non-zero where the loss applies; becomes ``loss_mask`` (bool). Defaults to
            every real token.
        **per_token_padded_fields: other ``(B, L, ...)`` tensors, kept at real tokens.

    Raises:
        BatchError: a field's leading shape is not ``(B, L)``.
    """
    if input_ids.dim() != 2:
        raise BatchError(f"padded_to_nopad: input_ids must be (B, L), got shape {tuple(input_ids.shape)}.")
    shape = tuple(input_ids.shape)
    mask = attention_mask.bool()
    named = {ATTENTION_MASK: attention_mask, **per_token_padded_fields}
    named.update(
        {k: v for k, v in ((POSITION_IDS, position_ids), (RESPONSE_MASK, response_mask)) if v is not None}
    )
    for name, value in named.items():
        if tuple(value.shape[:2]) != shape:
            raise BatchError(
                f"padded_to_nopad: {name} has shape {tuple(value.shape)}, its first two dims must be {shape} "
                "like input_ids."
            )
    lengths = mask.sum(1)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=input_ids.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    if position_ids is None:
        position_ids = torch.cumsum(mask, 1) - 1
    if response_mask is None:
        loss_mask = mask.to(LOSS_MASK_DTYPE)
    else:
        rows = torch.arange(shape[0] + 1, device=input_ids.device) * shape[1]
        loss_mask = as_loss_mask(response_mask.reshape(-1), rows, "padded_to_nopad: response_mask").view(
            shape
        )
    fields = {
        INPUT_IDS: input_ids,
        POSITION_IDS: position_ids,
        LOSS_MASK: loss_mask,
        **per_token_padded_fields,
    }
    batch = TensorDict({k: jagged(v[mask], offsets) for k, v in fields.items()}, batch_size=[len(lengths)])
    validate_batch(batch)
    return batch


def nopad_to_padded(
    batch: TensorDict,
    *,
    prompt_lengths: Tensor,
    max_prompt_len: int | None = None,
    max_response_len: int | None = None,
    pad_token_id: int = 0,
) -> dict[str, Tensor]:
    """Left-pad prompts and right-pad responses of a no-padding batch (the exact inverse of padded_to_nopad).

    Args:
        batch: a no-padding batch.
        prompt_lengths: ``(n,)`` prompt tokens at the start of each sequence; the rest is the response.
        max_prompt_len: prompt width; defaults to the longest prompt.
        max_response_len: response width; defaults to the longest response.
        pad_token_id: fill of ``input_ids`` at padding; every other field is filled with 0.

    Returns:
        ``input_ids``, ``attention_mask`` (int64), ``position_ids``, ``response_mask`` (int64, from
        ``loss_mask``) and every other per-token field, each ``(n, max_prompt_len + max_response_len, ...)``.

    Raises:
        BatchError: a prompt or response does not fit its width, or a prompt is longer than its sequence.
    """
    validate_batch(batch)
    offsets = offsets_of(batch[INPUT_IDS])
    lengths = offsets.diff()
    prompt_lengths = prompt_lengths.to(torch.int64).to(offsets.device)
    response_lengths = lengths - prompt_lengths
    prompt_width = _width("prompt", prompt_lengths, max_prompt_len, "max_prompt_len")
    response_width = _width("response", response_lengths, max_response_len, "max_response_len")
    row = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths)
    col = torch.arange(int(offsets[-1]), device=offsets.device) - offsets[:-1][row] + prompt_width
    col -= prompt_lengths[row]
    width = prompt_width + response_width
    out = {}
    for key in token_keys(batch):
        flat = batch[key].values()
        fill = pad_token_id if key == INPUT_IDS else 0
        dense = flat.new_full((len(lengths), width, *flat.shape[1:]), fill)
        dense[row, col] = flat
        name = RESPONSE_MASK if key == LOSS_MASK else key
        out[name] = dense.to(torch.int64) if key == LOSS_MASK else dense
    attention = torch.zeros(len(lengths), width, dtype=torch.int64, device=offsets.device)
    attention[row, col] = 1
    out[ATTENTION_MASK] = attention
    return out


def _width(part: str, lengths: Tensor, width: int | None, option: str) -> int:
    if len(lengths) and int(lengths.min()) < 0:
        i = int(lengths.argmin())
        raise BatchError(
            f"nopad_to_padded: sequence {i} has a negative {part} length {int(lengths[i])}; prompt_lengths must "
            "not exceed the sequence lengths."
        )
    longest = int(lengths.max()) if len(lengths) else 0
    if width is None:
        return longest
    if longest > width:
        raise BatchError(
            f"nopad_to_padded: a {part} has {longest} tokens but {option}={width}; raise {option} to {longest}."
        )
    return width
