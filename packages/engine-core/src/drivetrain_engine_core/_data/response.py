"""Response-aligned views of per-token tensors, and response-width ``(n, R)`` fields back to jagged ones.

With the alignment of docs §7.1 (position ``i`` scores token ``i``), a response of ``r`` tokens at the end of a
sequence owns exactly its last ``r`` positions, so the response view is a slice, no shift.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._errors import BatchError
from .batch import is_jagged, jagged
from .jagged import offsets_of, ragged_dim_of


def _response_index(offsets: Tensor, response_lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Flat indices of the response tokens and the offsets of the response view."""
    lengths = offsets.diff()
    response_lengths = response_lengths.to(device=offsets.device, dtype=torch.int64)
    if response_lengths.shape != lengths.shape:
        raise BatchError(
            f"response_lengths has shape {tuple(response_lengths.shape)}, expected ({len(lengths)},): one per "
            "sequence."
        )
    bad = ((response_lengths < 0) | (response_lengths > lengths)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise BatchError(
            f"response_lengths[{i}] = {int(response_lengths[i])} but sequence {i} has {int(lengths[i])} tokens; "
            "a response length must be between 0 and the sequence length."
        )
    device = offsets.device
    new_offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=device)
    torch.cumsum(response_lengths, 0, out=new_offsets[1:])
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), response_lengths)
    within = torch.arange(int(new_offsets[-1]), device=device) - new_offsets[:-1][row]
    return offsets[1:][row] - response_lengths[row] + within, new_offsets


def response_view(values: Tensor, response_lengths: Tensor) -> Tensor:
    """The last ``response_lengths[b]`` positions of each sequence of a jagged ``(n, j, ...)`` tensor.

    Raises:
        BatchError: ``values`` is not jagged or a response length exceeds its sequence.
    """
    if not is_jagged(values) or ragged_dim_of(values) != 1:
        raise BatchError("response_view: values must be a jagged nested tensor with ragged dim 1.")
    index, offsets = _response_index(offsets_of(values), response_lengths)
    return jagged(values.values()[index], offsets)


def response_to_padded(
    values: Tensor, response_lengths: Tensor, max_response_len: int, pad_value: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Response positions as a dense right-padded ``(n, R, ...)`` tensor plus a bool ``(n, R)`` mask.

    Raises:
        BatchError: a response is longer than ``max_response_len``.
    """
    if int(response_lengths.max()) > max_response_len:
        raise BatchError(
            f"response_to_padded: a response has {int(response_lengths.max())} tokens, more than "
            f"max_response_len={max_response_len}; raise max_response_len."
        )
    view = response_view(values, response_lengths)
    flat = view.values()
    offsets = offsets_of(view)
    n = len(offsets) - 1
    row = torch.repeat_interleave(torch.arange(n, device=flat.device), offsets.diff())
    col = torch.arange(len(flat), device=flat.device) - offsets[:-1][row]
    dense = flat.new_full((n, max_response_len, *flat.shape[1:]), pad_value)
    dense[row, col] = flat
    mask = torch.zeros(n, max_response_len, dtype=torch.bool, device=flat.device)
    mask[row, col] = True
    return dense, mask


def padded_to_response(dense: Tensor, response_lengths: Tensor) -> Tensor:
    """The inverse of :func:`response_to_padded`: row ``b``'s first ``response_lengths[b]`` positions of a
    right-padded response-width ``(n, R, ...)`` tensor, as a jagged ``(n, j, ...)`` tensor (verl's
    ``response_to_nested``: advantages or returns computed padded, handed back per token).

    Raises:
        BatchError: ``dense`` is not ``(n, R, ...)`` with one row per length, or a length is outside ``[0, R]``.
    """
    lengths = response_lengths.to(device=dense.device, dtype=torch.int64)
    if dense.is_nested or dense.dim() < 2 or lengths.shape != dense.shape[:1]:
        raise BatchError(
            f"padded_to_response: values must be a dense (n, R, ...) tensor with one row per response length, "
            f"got shape {tuple(dense.shape)} for {tuple(lengths.shape)} lengths."
        )
    width = dense.shape[1]
    bad = ((lengths < 0) | (lengths > width)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise BatchError(
            f"padded_to_response: response_lengths[{i}] = {int(lengths[i])} is outside [0, {width}], the width "
            "of the padded values."
        )
    keep = torch.arange(width, device=dense.device) < lengths[:, None]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=dense.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return jagged(dense[keep], offsets)
