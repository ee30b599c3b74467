"""``model_kwargs``: the keyword arguments of the Hugging Face forward for core's layout of a micro-batch.

Core lays the micro-batch out (:class:`~drivetrain_engine_core.backend.MicroBatch`): one packed row, possibly
this rank's Ulysses slice of it, or right-padded rows. Packed rows go with ``cu_seq_lens_q`` to the
per-sequence attention function (``cu_seq_lens_q`` describes the whole row under Ulysses), with the row's
host ``max_length_q`` and ``sequence_lengths`` so that no layer reads lengths back from the device; padded rows go with
an ``attention_mask``, which transformers' SDPA turns into a key-padding mask. ``use_cache=False`` in both:
with a cache transformers does not detect packed sequences.
"""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.backend import MicroBatch, PackedRow, PaddedRows
from drivetrain_engine_core.kit import SequenceLengths


def model_kwargs(micro_batch: MicroBatch) -> dict[str, Any]:
    """Forward keyword arguments of ``micro_batch.inputs`` (already on the model's device)."""
    inputs = micro_batch.inputs
    if isinstance(inputs, PaddedRows):
        return {
            "input_ids": inputs.input_ids,
            "position_ids": inputs.position_ids,
            "attention_mask": inputs.valid.long(),
            "use_cache": False,
        }
    return packed_row_kwargs(inputs)


def packed_row_kwargs(row: PackedRow) -> dict[str, Any]:
    """Forward keyword arguments of one packed row for the ``drivetrain_varlen`` attention (also what bare
    loops over the same rows pass: the benchmarks' reference loops, the host-sync test)."""
    return {
        "input_ids": row.input_ids,
        "position_ids": row.position_ids,
        "cu_seq_lens_q": row.cu_seqlens,
        "max_length_q": row.max_seqlen,
        # One opaque value, not a tuple: FSDP2's hooks walk every layer's keywords element by element.
        "sequence_lengths": SequenceLengths(row.lengths),
        "use_cache": False,
    }
