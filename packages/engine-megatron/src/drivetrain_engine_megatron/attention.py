"""A megatron core-attention module for where Transformer Engine is absent.

Transformer Engine's fused attention handles packed (``thd``) rows on GPUs; megatron's own
``DotProductAttention`` refuses them. Where Transformer Engine is absent, this module takes its place in the
layer spec. A packed row goes to core's
:func:`~drivetrain_engine_core.kit.packed_causal_attention` (the backends share it: torch's
variable-length flash kernel on CUDA in half precision, causal SDPA per sequence elsewhere), with the host
lengths ``inputs.PackedRowParams`` carries, so no token sees another sequence, no total-by-total mask is
built and no layer reads ``cu_seqlens`` back from the device. Padded rows (``sbhd``, right-padded) use one
SDPA call with the boolean mask megatron passes (``True`` = masked out).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.kit import packed_causal_attention
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .rope import TokenRotary


class SdpaCoreAttention(MegatronModule):
    """Drop-in for megatron's ``DotProductAttention`` (same constructor), packed-sequence aware.

    Args:
        config: the transformer config (heads, head size, dropout).
        layer_number: 1-based layer index (unused: no query-key layer scaling).
        attn_mask_type: causal for decoder self-attention.
        attention_type: ``"self"``.
        attention_dropout: overrides ``config.attention_dropout``.
        softmax_scale: overrides ``1 / sqrt(head_dim)``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
        *,
        rotary_base: float,
    ) -> None:
        super().__init__(config=config)
        del layer_number, attention_type, cp_comm_type, pg_collection
        if config.context_parallel_size != 1:
            raise ConfigError(
                "SdpaCoreAttention does not implement context parallelism; context_parallel_size > 1 needs "
                "Transformer Engine attention (CUDA)."
            )
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.rotary = TokenRotary(head_dim, rotary_base)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attend; returns ``[t, heads * head_dim]`` for packed input, ``[s, b, heads * head_dim]`` otherwise."""
        if attention_bias is not None:
            raise ValueError("SdpaCoreAttention does not support attention_bias.")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        return self._padded(query, key, value, attention_mask)

    def _sdpa(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA on ``[b, heads, s, d]`` tensors; grouped-query heads are shared, dropout only in training."""
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=key.shape[1] != query.shape[1],
        )

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """``[t, heads, d]`` in, ``[t, heads * d]`` out: rotated at the row's positions, then core's packed
        causal attention (flash on CUDA)."""
        lengths, positions = getattr(params, "sequence_lengths", None), getattr(params, "positions", None)
        if not lengths or positions is None:
            raise ValueError(
                "SdpaCoreAttention needs the host sequence lengths and the positions of a packed row; build "
                "packed_seq_params with drivetrain_engine_megatron.inputs.model_kwargs (PackedRowParams), not "
                "PackedSeqParams."
            )
        query, key = self.rotary(query, key, positions)
        out = packed_causal_attention(
            query,
            key,
            value,
            cu_seqlens=params.cu_seqlens_q,
            max_seqlen=params.max_seqlen_q,
            lengths=lengths,
            scale=self.softmax_scale,
            dropout=self.dropout_p if self.training else 0.0,
        )
        return out.reshape(out.shape[0], -1)

    def _padded(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``[s, b, heads, d]`` in, ``[s, b, heads * d]`` out; right-padded rows are rotated at ``0..s-1``;
        ``attention_mask`` is ``True`` where masked."""
        positions = torch.arange(query.shape[0], device=query.device)
        query, key = self.rotary(query, key, positions)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask
        out = self._sdpa(q, k, v, mask)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
