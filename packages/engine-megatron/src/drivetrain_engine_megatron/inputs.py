"""Turn a no-padding micro-batch into ``GPTModel`` inputs, packed (THD) or right-padded.

Packed: one row ``(1, T)`` and ``PackedSeqParams`` (``thd``), so attention and RoPE restart at every
sequence (``cu_seqlens``). Padded: ``(n, max_len)`` right-padded rows with a causal-and-key-padding mask;
right padding keeps every sequence at positions ``0..len-1``, which is what ``GPTModel``'s RoPE uses, so
both layouts give the same numbers. Model outputs are brought back to the packed token order either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from drivetrain_engine_core.data.packing import PackedRow, pack_micro_batch
from megatron.core.packed_seq_params import PackedSeqParams
from tensordict import TensorDict


@dataclass
class ModelInputs:
    """What one micro-batch's forward needs, plus how to read its outputs back.

    Attributes:
        packed: the micro-batch as one packed row (token order of every per-token output).
        input_ids: ``(1, T)`` packed or ``(n, max_len)`` padded ids.
        position_ids: positions of the same shape.
        attention_mask: ``None`` (packed) or ``(n, 1, max_len, max_len)`` bool, ``True`` = masked out.
        packed_seq_params: THD parameters (packed) or ``None``.
        valid: ``None`` (packed) or ``(n, max_len)`` bool, the real (non-padding) positions.
    """

    packed: PackedRow
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_params: PackedSeqParams | None
    valid: torch.Tensor | None

    def model_kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``GPTModel.forward``."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "packed_seq_params": self.packed_seq_params,
        }

    def to_packed(self, output: torch.Tensor) -> torch.Tensor:
        """Model output ``(batch, seq, ...)`` as packed per-token rows ``(T, ...)``."""
        return output[0] if self.valid is None else output[self.valid]


def prepare_model_inputs(micro_batch: TensorDict, *, remove_padding: bool, device: str) -> ModelInputs:
    """Build the forward inputs of ``micro_batch`` on ``device``."""
    packed = pack_micro_batch(micro_batch)
    if remove_padding:
        cu_seqlens = packed.cu_seqlens.to(device)
        return ModelInputs(
            packed=packed,
            input_ids=packed.input_ids.to(device),
            position_ids=packed.position_ids.to(device),
            attention_mask=None,
            packed_seq_params=PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_kv=cu_seqlens,
                max_seqlen_q=packed.max_seqlen,
                max_seqlen_kv=packed.max_seqlen,
            ),
            valid=None,
        )
    return _right_padded(packed, device)


def _right_padded(packed: PackedRow, device: str) -> ModelInputs:
    # NOTE: every tensor is made on ``device`` (the micro-batch's): built on the default device instead, the
    # index and mask arithmetic mixes devices as soon as the micro-batch lives on an accelerator.
    lengths = packed.offsets.diff().to(device)
    width = packed.max_seqlen
    positions = torch.arange(width, device=device)
    valid = positions.unsqueeze(0) < lengths.unsqueeze(1)
    input_ids = torch.zeros(valid.shape, dtype=packed.input_ids.dtype, device=device)
    input_ids[valid] = packed.input_ids[0].to(device)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = causal.unsqueeze(0) & valid.unsqueeze(1)
    return ModelInputs(
        packed=packed,
        input_ids=input_ids,
        position_ids=positions.expand(valid.shape).clone(),
        attention_mask=(~allowed).unsqueeze(1),
        packed_seq_params=None,
        valid=valid,
    )
