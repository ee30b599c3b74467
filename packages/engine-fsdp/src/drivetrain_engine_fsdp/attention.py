"""Per-sequence attention over a packed row, registered through transformers' ``AttentionInterface``.

A packed row ``(1, T)`` holds several sequences back to back. transformers' SDPA path turns restarting
``position_ids`` into a ``T x T`` block mask, which costs what the *row* costs. This function instead cuts
query/key/value at ``cu_seqlens`` and attends each sequence causally on its own, so attention costs what the
sequences cost. On CUDA with flash-attention installed (and half-precision compute) it calls the
variable-length kernel in one launch.

The model is told to use it with ``attn_implementation=VARLEN_ATTENTION`` and receives the boundaries through
the ``cu_seq_lens_q`` (device), ``max_length_q`` and ``sequence_lengths`` (host) forward keywords, which
transformers passes down to every attention call. Nothing here reads the device: a ``.tolist()`` per layer
would stall the host until the GPU has caught up, 24 times per forward of a 24-layer model.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

VARLEN_ATTENTION = "drivetrain_varlen"
_FLASH_AVAILABLE = importlib.util.find_spec("flash_attn") is not None
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the kernel has no float32 variant


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    sequence_lengths: tuple[int, ...] | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal attention per packed sequence.

    Args:
        module: the attention module (gives ``num_key_value_groups``).
        query, key, value: ``(1, heads, T, head_dim)``.
        attention_mask: must be ``None`` (a packed row has no padding mask).
        dropout: attention dropout probability.
        scaling: softmax scale.
        cu_seq_lens_q: int32 cumulative sequence lengths ``(num_sequences + 1,)`` of the row, on its device.
        max_length_q: the longest sequence (host integer).
        sequence_lengths: the lengths ``cu_seq_lens_q`` describes (host integers).

    Returns:
        ``(output (1, T, heads, head_dim), None)`` as transformers' attention functions return.

    Raises:
        ValueError: called without ``cu_seq_lens_q`` or with a padding mask or a batch of several rows.
    """
    if (
        cu_seq_lens_q is None
        or max_length_q is None
        or sequence_lengths is None
        or attention_mask is not None
        or query.shape[0] != 1
    ):
        raise ValueError(
            f"{VARLEN_ATTENTION} attention needs one packed row (batch 1), no attention_mask, cu_seq_lens_q, "
            f"max_length_q and sequence_lengths; got batch {query.shape[0]}, mask "
            f"{'set' if attention_mask is not None else 'None'}, cu_seq_lens_q "
            f"{'set' if cu_seq_lens_q is not None else 'None'}, max_length_q {max_length_q}, sequence_lengths "
            f"{'set' if sequence_lengths is not None else 'None'}. Pass inputs from drivetrain_engine_fsdp.inputs."
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if _FLASH_AVAILABLE and query.is_cuda and query.dtype in _FLASH_DTYPES:
        return _flash_varlen(query, key, value, cu_seq_lens_q, max_length_q, dropout, scaling), None
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    lengths = list(sequence_lengths)
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """flash-attention's variable-length kernel on ``(T, heads, head_dim)`` views (GQA handled natively)."""
    from flash_attn import flash_attn_varlen_func

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling, causal=True
    )
    return out.unsqueeze(0)


def register_varlen_attention() -> str:
    """Register :func:`varlen_attention_forward` (idempotent) and return its ``attn_implementation`` name."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION
