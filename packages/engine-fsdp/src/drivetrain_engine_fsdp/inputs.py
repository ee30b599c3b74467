"""``prepare_model_inputs``: a no-padding micro-batch -> keyword arguments of the Hugging Face forward.

Three layouts, one result type:

* packed (``use_remove_padding=True``): one row ``(1, T)`` with restarting ``position_ids`` and
  ``cu_seq_lens_q`` for the per-sequence attention function;
* packed and split for Ulysses: the row is padded to a multiple of the SP size and each rank gets its
  contiguous slice (``cu_seq_lens_q`` still describes the whole row);
* padded (``use_remove_padding=False``): right-padded ``(n, L)`` rows with an ``attention_mask``.

Every layout records how its per-position outputs map back onto the packed token order, so that
``outputs.py`` has a single path from logits to jagged per-token tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from drivetrain_engine_core.data.batch import INPUT_IDS, POSITION_IDS
from drivetrain_engine_core.data.packing import next_token_labels, pack_micro_batch
from tensordict import TensorDict

from .ulysses import local_slice, pad_row_for_sp


@dataclass
class ModelInputs:
    """A micro-batch laid out for the model, and how to read its outputs back.

    Attributes:
        kwargs: keyword arguments of the Hugging Face model's forward.
        labels: next-token id of every position this rank computes, in the order of its output rows.
        offsets: the batch's int64 ``input_ids`` offsets (unpacking target).
        num_tokens: real tokens of the micro-batch (``offsets[-1]``).
        padded_index: for padded rows, the flat ``(n * L)`` index of every real token in packed order.
        sp_group: the Ulysses group whose slices are gathered after the forward, or ``None``.
    """

    kwargs: dict[str, Any]
    labels: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    padded_index: torch.Tensor | None = None
    sp_group: Any = field(default=None)


def prepare_model_inputs(
    micro_batch: TensorDict,
    *,
    use_remove_padding: bool,
    sp_group: Any = None,
    sp_rank: int = 0,
    sp_size: int = 1,
) -> ModelInputs:
    """Lay out ``micro_batch`` (already on the model's device) for the model; see the module docstring."""
    if not use_remove_padding:
        return _padded_inputs(micro_batch)
    row = pack_micro_batch(micro_batch)
    input_ids, position_ids, cu_seqlens = row.input_ids, row.position_ids, row.cu_seqlens
    if sp_size > 1:
        input_ids, position_ids, cu_seqlens = pad_row_for_sp(input_ids, position_ids, cu_seqlens, sp_size)
    labels = next_token_labels(input_ids[0], cu_seqlens)
    if sp_size > 1:
        input_ids, position_ids = (
            local_slice(input_ids, sp_rank, sp_size),
            local_slice(position_ids, sp_rank, sp_size),
        )
        labels = local_slice(labels.unsqueeze(0), sp_rank, sp_size)[0]
    kwargs = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "cu_seq_lens_q": cu_seqlens,
        "use_cache": False,
    }
    return ModelInputs(
        kwargs=kwargs,
        labels=labels,
        offsets=row.offsets,
        num_tokens=int(row.offsets[-1]),
        sp_group=sp_group if sp_size > 1 else None,
    )


def _padded_inputs(micro_batch: TensorDict) -> ModelInputs:
    """Right-padded rows; transformers' SDPA masks the padding, ``use_cache=False`` as in the packed path."""
    ids, positions = micro_batch[INPUT_IDS], micro_batch[POSITION_IDS]
    offsets = ids.offsets()
    lengths = offsets.diff()
    width = int(lengths.max())
    attention_mask = torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
    kwargs = {
        "input_ids": ids.to_padded_tensor(0, output_size=(len(lengths), width)),
        "position_ids": positions.to_padded_tensor(0, output_size=(len(lengths), width)),
        "attention_mask": attention_mask.long(),
        "use_cache": False,
    }
    return ModelInputs(
        kwargs=kwargs,
        labels=next_token_labels(ids.values(), offsets),
        offsets=offsets,
        num_tokens=int(offsets[-1]),
        padded_index=attention_mask.flatten().nonzero().squeeze(1),
    )
