"""``model_kwargs``: ``GPTModel.forward`` arguments for core's layout of a micro-batch, packed (THD) or padded.

Core lays the micro-batch out (:class:`~drivetrain_engine_core.backend.MicroBatch`). A packed row goes with
``PackedSeqParams`` (``thd``), so attention and RoPE restart at every sequence (``cu_seqlens``). Right-padded
rows go with megatron's boolean attention mask (``True`` = masked out: causal, and never a padding key);
right padding keeps every sequence at positions ``0..len-1``, which is what ``GPTModel``'s RoPE uses, so both
layouts give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.backend import MicroBatch, PaddedRows
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedRowParams(PackedSeqParams):
    """megatron's ``thd`` parameters plus what drivetrain's core attention reads instead of the device.

    megatron passes the object unchanged down to each layer's core attention, which takes the lengths from
    ``sequence_lengths`` (host integers; not ``cu_seqlens_q.tolist()``, a host sync per layer) and rotates
    query and key at ``positions`` (``[t]``, restarting at every sequence; see :mod:`.rope`).
    """

    sequence_lengths: tuple[int, ...] = ()
    positions: torch.Tensor | None = None


def model_kwargs(micro_batch: MicroBatch) -> dict[str, object]:
    """Keyword arguments of ``GPTModel.forward`` for ``micro_batch.inputs`` (already on the model's device)."""
    inputs = micro_batch.inputs
    if isinstance(inputs, PaddedRows):
        return {
            "input_ids": inputs.input_ids,
            "position_ids": inputs.position_ids,
            "attention_mask": padded_attention_mask(inputs.valid),
            "packed_seq_params": None,
        }
    return {
        "input_ids": inputs.input_ids,
        "position_ids": inputs.position_ids,
        "attention_mask": None,
        "packed_seq_params": PackedRowParams(
            qkv_format="thd",
            cu_seqlens_q=inputs.cu_seqlens,
            cu_seqlens_kv=inputs.cu_seqlens,
            max_seqlen_q=inputs.max_seqlen,
            max_seqlen_kv=inputs.max_seqlen,
            sequence_lengths=inputs.lengths,
            positions=inputs.position_ids[0],
        ),
    }


def padded_attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """``(n, 1, L, L)`` bool, ``True`` where a query may not attend: future keys and padding keys."""
    width = valid.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=valid.device).tril()
    return (~(causal.unsqueeze(0) & valid.unsqueeze(1))).unsqueeze(1)
