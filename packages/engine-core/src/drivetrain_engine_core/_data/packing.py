"""The two model layouts of a micro-batch (packed row, right-padded rows) and the way back to tokens.

A packed row concatenates the sequences of a micro-batch: ``input_ids`` ``(1, T)``, per-sequence restarting
``position_ids`` ``(1, T)`` (or ``(1, T, extra)`` for multi-axis rope positions; extra dims stay last) and
``cu_seqlens`` (int32, ``(n + 1,)``) as flash-attention and Megatron's THD format expect. Padded rows put each
sequence at the start of its own row of width ``max_seqlen`` with a ``valid`` mask at real tokens.

:class:`~drivetrain_engine_core._round_trip.MicroBatch` strings these together: it lays a micro-batch out,
gathers :func:`next_token_labels`, and brings per-position outputs back with
:func:`shift_right_per_sequence` (position ``i`` scores token ``i``, docs §7.1; each first position gets 0)
and :func:`unpack_to_jagged`. Backends use the ``MicroBatch``, not these steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor

from .._errors import BatchError
from .batch import INPUT_IDS, POSITION_IDS, jagged
from .jagged import offsets_of


@dataclass(frozen=True)
class PackedRow:
    """One micro-batch as a single packed row.

    Attributes:
        input_ids: ``(1, T)`` token ids.
        position_ids: ``(1, T)`` or ``(1, T, extra...)`` positions, restarting at each sequence.
        cu_seqlens: ``(n + 1,)`` int32 cumulative sequence lengths, starting at 0.
        max_seqlen: length of the longest sequence.
        offsets: the batch's int64 ``input_ids`` offsets; pass as ``cu_seqlens`` to :func:`unpack_to_jagged`
            to get outputs that combine with the batch's own jagged fields.
        lengths: the sequence lengths ``cu_seqlens`` describes, as host integers, so that per-layer code
            (attention) never reads them back from the device.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    offsets: Tensor
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class PaddedRows:
    """One micro-batch as right-padded rows: sequence ``b`` fills ``[b, :len_b]``, zeros after it.

    Right padding keeps every sequence at its own positions, so attention with a key-padding mask (causal
    inside the row) gives the numbers of the packed row.

    Attributes:
        input_ids: ``(n, L)`` token ids, 0 at padding; ``L`` is the longest sequence.
        position_ids: ``(n, L)`` or ``(n, L, extra...)`` positions, 0 at padding.
        valid: ``(n, L)`` bool, true at real tokens (the attention mask).
        max_seqlen: ``L``.
        offsets: the batch's int64 ``input_ids`` offsets.
        token_positions: ``(T,)`` int64 index of each real token in the ``n * L`` row-major positions, in packed
            token order: ``output.flatten(0, 1)[token_positions]`` is the real tokens' outputs. Made on the host
            from its lengths, so neither spreading tokens into rows nor gathering them back reads the device
            (``output[valid]`` waits for it, to count the true entries).
    """

    input_ids: Tensor
    position_ids: Tensor
    valid: Tensor
    max_seqlen: int
    offsets: Tensor
    token_positions: Tensor


def pack_micro_batch(batch: TensorDict, lengths: Sequence[int] | None = None) -> PackedRow:
    """Concatenate the sequences of ``batch`` into one :class:`PackedRow` (no copy of token data).

    Args:
        batch: a no-padding micro-batch.
        lengths: its sequence lengths when already known (read on the host before a move to the device,
            which spares a device sync); read from the offsets otherwise.
    """
    ids = batch[INPUT_IDS]
    offsets = offsets_of(ids)
    host_lengths = tuple(int(n) for n in (offsets.diff().tolist() if lengths is None else lengths))
    return PackedRow(
        input_ids=ids.values().unsqueeze(0),
        position_ids=batch[POSITION_IDS].values().unsqueeze(0),
        cu_seqlens=offsets.to(torch.int32),
        max_seqlen=max(host_lengths),
        offsets=offsets,
        lengths=host_lengths,
    )


def pad_micro_batch(
    batch: TensorDict, max_seqlen: int | None = None, lengths: Sequence[int] | None = None
) -> PaddedRows:
    """Lay the sequences of ``batch`` out as :class:`PaddedRows`, every tensor on the batch's device.

    Args:
        batch: a no-padding micro-batch.
        max_seqlen: as in :func:`pack_micro_batch`.
        lengths: as in :func:`pack_micro_batch`: its sequence lengths when known on the host.
    """
    ids, positions = batch[INPUT_IDS], batch[POSITION_IDS]
    offsets = offsets_of(ids)
    host_lengths = torch.tensor(
        offsets.diff().tolist() if lengths is None else list(lengths), dtype=torch.int64, device="cpu"
    )
    width = int(host_lengths.max()) if max_seqlen is None else max_seqlen
    # NOTE: made on the batch's device: on the default device, the index arithmetic mixes devices as soon as
    # the micro-batch lives on an accelerator.
    columns = torch.arange(width, device=offsets.device)
    valid = columns.unsqueeze(0) < offsets.diff().unsqueeze(1)
    token_positions = _token_positions(host_lengths, width).to(offsets.device, non_blocking=True)

    def spread(flat: Tensor) -> Tensor:
        dense = flat.new_zeros((len(offsets) - 1, width, *flat.shape[1:]))
        dense.view(-1, *flat.shape[1:])[token_positions] = flat
        return dense

    return PaddedRows(
        input_ids=spread(ids.values()),
        position_ids=spread(positions.values()),
        valid=valid,
        max_seqlen=width,
        offsets=offsets,
        token_positions=token_positions,
    )


def _token_positions(lengths: Tensor, width: int) -> Tensor:
    """Row-major index of each real token of rows ``width`` wide holding sequences of ``lengths``, on the host
    (whatever the default device is)."""
    rows = torch.repeat_interleave(torch.arange(len(lengths), device="cpu"), lengths)
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return rows * width + torch.arange(int(lengths.sum()), device="cpu") - starts


def pad_packed_row(row: PackedRow, labels: Tensor, multiple: int) -> tuple[PackedRow, Tensor]:
    """``row`` and its per-position ``labels`` ``(T,)`` padded to a multiple of ``multiple`` tokens.

    The padding is one extra sequence (its own ``cu_seqlens`` segment and host length, positions from 0, token
    and label 0), so it never attends to or is attended by real tokens; ``offsets`` still describe the real
    tokens, and callers drop the padding's outputs (``MicroBatch.to_tokens`` keeps ``num_tokens`` positions).
    """
    total = row.input_ids.shape[1]
    pad = (-total) % multiple
    if pad == 0:
        return row, labels
    extra = torch.arange(pad, device=row.position_ids.device, dtype=row.position_ids.dtype)
    extra = extra.view(1, pad, *([1] * (row.position_ids.dim() - 2))).expand(
        1, pad, *row.position_ids.shape[2:]
    )
    padded = PackedRow(
        input_ids=torch.nn.functional.pad(row.input_ids, (0, pad)),
        position_ids=torch.cat([row.position_ids, extra], dim=1),
        cu_seqlens=torch.cat([row.cu_seqlens, row.cu_seqlens.new_tensor([total + pad])]),
        max_seqlen=max(row.max_seqlen, pad),
        offsets=row.offsets,
        lengths=(*row.lengths, pad),
    )
    return padded, torch.nn.functional.pad(labels, (0, pad))


def unpack_to_jagged(flat: Tensor, cu_seqlens: Tensor, num_tokens: int | None = None) -> Tensor:
    """Per-token packed values ``(T, ...)`` as a jagged ``(n, j, ...)`` tensor with ragged dim 1.

    Args:
        flat: packed values, first dim ``T`` (squeeze a leading 1 first).
        cu_seqlens: cumulative lengths; pass :attr:`PackedRow.offsets` (the batch's own offsets tensor) so the
            result multiplies with the batch's jagged fields; other tensors (int32, or on another device than
            ``flat``) are converted to int64 on ``flat``'s device, which gives a jagged tensor of its own.
        num_tokens: ``cu_seqlens[-1]`` when the caller knows it on the host; reading it from device offsets
            would wait for the device (once per micro-batch in the engines' hot path).

    Raises:
        BatchError: ``flat`` has not ``cu_seqlens[-1]`` rows.
    """
    total = int(cu_seqlens[-1]) if num_tokens is None else num_tokens
    if flat.dim() < 1 or flat.shape[0] != total:
        raise BatchError(
            f"unpack_to_jagged: flat values have shape {tuple(flat.shape)}, expected first dim {total} "
            "(cu_seqlens[-1]); squeeze the packed row's leading batch dim of 1."
        )
    same = cu_seqlens.dtype == torch.int64 and cu_seqlens.device == flat.device
    offsets = cu_seqlens if same else cu_seqlens.to(device=flat.device, dtype=torch.int64)
    return jagged(flat, offsets)


def shift_right_per_sequence(flat: Tensor, cu_seqlens: Tensor, fill: float = 0) -> Tensor:
    """Move packed values one position right inside each sequence; each sequence's first position gets ``fill``.

    Turns "position ``p`` predicts token ``p + 1``" into "position ``i`` scores token ``i``" (docs §7.1).

    Args:
        flat: packed values ``(T, ...)``.
        cu_seqlens: cumulative lengths ``(n + 1,)``.
    """
    shifted = torch.roll(flat, shifts=1, dims=0)
    is_start = _marks(cu_seqlens[:-1], flat.shape[0], flat.device)
    filler = torch.full((), fill, dtype=flat.dtype, device=flat.device)
    return torch.where(_broadcastable(is_start, shifted), filler, shifted)


def next_token_labels(flat_input_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
    """For each packed position, the id of the next token of the same sequence (``(T,)``).

    The last position of each sequence has no next token; it gets id 0, a valid index whose score
    :func:`shift_right_per_sequence` then drops.
    """
    labels = torch.roll(flat_input_ids, shifts=-1, dims=0)
    # Position p ends its sequence when p + 1 is an end offset.
    is_end = _marks(cu_seqlens[1:] - 1, flat_input_ids.shape[0], flat_input_ids.device)
    return torch.where(is_end, torch.zeros((), dtype=labels.dtype, device=labels.device), labels)


def _marks(positions: Tensor, total: int, device: torch.device) -> Tensor:
    """``(total,)`` bool, True at ``positions``; positions outside ``[0, total)`` (empty sequences) are ignored.

    NOTE: written into a buffer with a slot on each side, so no position is dropped by a data-dependent filter:
    a boolean-mask index would wait for the device to learn the result's size, once per micro-batch.
    """
    marks = torch.zeros(total + 2, dtype=torch.bool, device=device)
    marks[positions.to(device=device, dtype=torch.int64).clamp(-1, total) + 1] = True
    return marks[1 : total + 1]


def _broadcastable(mask: Tensor, like: Tensor) -> Tensor:
    return mask.reshape(mask.shape + (1,) * (like.dim() - 1))
