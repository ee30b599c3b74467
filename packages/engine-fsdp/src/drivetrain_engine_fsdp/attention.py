"""Per-sequence attention over a packed row, registered through transformers' ``AttentionInterface``.

A packed row ``(1, T)`` holds several sequences back to back. transformers' SDPA path turns restarting
``position_ids`` into a ``T x T`` block mask, which costs what the *row* costs. This function instead cuts
query/key/value at ``cu_seqlens`` and attends each sequence causally on its own, so attention costs what the
sequences cost. On CUDA with half-precision compute it calls torch's variable-length flash kernel
(``torch.nn.attention.varlen.varlen_attn``) once per layer for all sequences, which also keeps the layer one
graph under ``torch.compile``; elsewhere (CPU, float32) it loops over the sequences with SDPA.

The model is told to use it with ``attn_implementation=VARLEN_ATTENTION`` and receives the boundaries through
the ``cu_seq_lens_q`` (device), ``max_length_q`` and ``sequence_lengths`` (host) forward keywords, which
transformers passes down to every attention call. Nothing here reads the device: a ``.tolist()`` per layer
would stall the host until the GPU has caught up, 24 times per forward of a 24-layer model.
"""

from __future__ import annotations

import inspect
import math
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import varlen
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

VARLEN_ATTENTION = "drivetrain_varlen"
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
    if query.is_cuda and query.dtype in _FLASH_DTYPES and dropout == 0.0 and _varlen_takes(scaling, query):
        return _torch_varlen(query, key, value, cu_seq_lens_q, max_length_q, scaling, groups), None
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    lengths = list(sequence_lengths)
    outputs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True)
        for q, k, v in zip(
            query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _torch_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scaling: float | None,
    groups: int,
) -> torch.Tensor:
    """torch's variable-length flash kernel on ``(T, heads, head_dim)`` views, causal, in one launch.

    NOTE: torch releases spell the same call differently: causal is ``is_causal=True`` in older ones and
    ``window_size=(-1, 0)`` in newer ones; ``scale`` and ``enable_gqa`` came later (2.11 has ``scale`` but not
    ``enable_gqa``: key/value are then repeated to the query's heads). :func:`_varlen_keywords` reads the
    signature.
    """
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    keywords = _varlen_keywords()
    if groups > 1 and "enable_gqa" not in keywords:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    options: dict[str, Any] = {}
    if "enable_gqa" in keywords:
        options["enable_gqa"] = groups > 1
    options.update({"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True})
    if "scale" in keywords:
        options["scale"] = scaling
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = varlen.varlen_attn(q, k, v, cu, cu, max_len, max_len, **options)
    assert isinstance(out, torch.Tensor)  # a tuple only when ``return_aux`` asks for the log-sum-exp
    return out.unsqueeze(0)


@cache
def _varlen_keywords() -> frozenset[str]:
    return frozenset(inspect.signature(varlen.varlen_attn).parameters)


def _varlen_takes(scaling: float | None, query: torch.Tensor) -> bool:
    """Whether the kernel can apply ``scaling``: always where it takes ``scale``, else only the default."""
    return "scale" in _varlen_keywords() or scaling is None or math.isclose(scaling, query.shape[-1] ** -0.5)


def register_varlen_attention() -> str:
    """Register :func:`varlen_attention_forward` (idempotent) and return its ``attn_implementation`` name."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION
