"""SdpaCoreAttention: query and key rotated at each token's position, packed rows attended per sequence, padded
rows giving the same numbers (single process), against RoPE and causal softmax attention written in the test."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("megatron.core")


def _attention(heads: int, groups: int, head_dim: int):
    from drivetrain_engine_megatron.attention import SdpaCoreAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    return SdpaCoreAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", rotary_base=BASE
    )


BASE = 10_000.0


def _rope(x: torch.Tensor) -> torch.Tensor:
    """One sequence ``[s, heads, d]`` rotated at positions ``0..s-1`` (rotate-half RoPE, base ``BASE``)."""
    dim = x.shape[-1]
    inverse = 1.0 / BASE ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inverse[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat((-second, first), dim=-1) * angles.sin()


def _manual_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Hand-written causal softmax attention of one rotated sequence, ``[s, heads, d]`` -> ``[s, heads * d]``."""
    q, k = _rope(q), _rope(k)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v).reshape(q.shape[0], -1)


def test_megatron_packed_attention_isolates_sequences_and_matches_padded():
    from drivetrain_engine_megatron.inputs import PackedRowParams

    torch.manual_seed(0)
    heads, groups, head_dim, lengths = 4, 2, 8, [3, 7, 1, 5]
    attention = _attention(heads, groups, head_dim).eval()
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, head_dim),
        torch.randn(total, groups, head_dim),
        torch.randn(total, groups, head_dim),
    )
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    # cu_seqlens on the meta device: the layer reads the host lengths, never the device (no sync per layer).
    on_meta = cu_seqlens.to("meta")
    positions = torch.cat([torch.arange(n) for n in lengths])  # restarting at every sequence
    params = PackedRowParams(
        qkv_format="thd", cu_seqlens_q=on_meta, cu_seqlens_kv=on_meta, max_seqlen_q=7, max_seqlen_kv=7,
        sequence_lengths=tuple(lengths), positions=positions,
    )  # fmt: skip
    packed = attention(q, k, v, None, packed_seq_params=params)

    bounds = cu_seqlens.tolist()
    expected = torch.cat([_manual_causal(q[s:e], k[s:e], v[s:e]) for s, e in itertools.pairwise(bounds)])
    torch.testing.assert_close(packed, expected, atol=1e-6, rtol=1e-6)

    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    padded = [torch.zeros(width, len(lengths), x.shape[1], head_dim) for x in (q, k, v)]
    for i, (s, e) in enumerate(itertools.pairwise(bounds)):
        for dst, src in zip(padded, (q, k, v), strict=True):
            dst[: e - s, i] = src[s:e]
    allowed = torch.ones(width, width, dtype=torch.bool).tril()[None] & valid[:, None, :]
    out = attention(*padded, (~allowed)[:, None])
    torch.testing.assert_close(out.transpose(0, 1)[valid], expected, atol=1e-6, rtol=1e-6)


def test_megatron_packed_attention_refuses_params_without_host_lengths():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor([0, 2], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=2, max_seqlen_kv=2
    )
    q = torch.zeros(2, 2, 4)
    with pytest.raises(ValueError, match="PackedRowParams"):
        _attention(2, 2, 4)(q, q, q, None, packed_seq_params=params)
