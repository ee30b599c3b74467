"""No device->host reads in the per-layer attention path: lengths arrive as host integers.

Counting syncs needs a GPU (the ``requires_cuda`` test); on CPU the same property is checked by structure: the
attention function gets ``cu_seq_lens_q`` on the ``meta`` device, where any read of its values would fail.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_engine_fsdp.attention import varlen_attention_forward
from transformers import AutoConfig, AutoModelForCausalLM

LENGTHS = (3, 5, 2)


class _Attention(torch.nn.Module):
    num_key_value_groups = 2


def per_sequence_reference(query, key, value):
    key, value = (t.repeat_interleave(2, dim=1) for t in (key, value))
    pieces = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for q, k, v in zip(*(t.split(LENGTHS, dim=2) for t in (query, key, value)), strict=True)
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2)


def test_attention_reads_no_lengths_from_the_device():
    generator = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    query = torch.randn(1, 4, total, 8, generator=generator)
    key, value = (torch.randn(1, 2, total, 8, generator=generator) for _ in range(2))
    cu_on_meta = torch.empty(len(LENGTHS) + 1, dtype=torch.int32, device="meta")

    output, _ = varlen_attention_forward(
        _Attention(),
        query,
        key,
        value,
        None,
        cu_seq_lens_q=cu_on_meta,
        max_length_q=max(LENGTHS),
        sequence_lengths=LENGTHS,
    )

    torch.testing.assert_close(output, per_sequence_reference(query, key, value))


@requires_cuda
def test_packed_forward_makes_no_host_sync(tmp_path):
    from drivetrain_engine_core._data.packing import pack_micro_batch
    from drivetrain_engine_core.testing import random_batch
    from drivetrain_engine_fsdp.attention import register_varlen_attention
    from drivetrain_engine_fsdp.inputs import packed_row_kwargs

    config = AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register_varlen_attention()).cuda()
    row = pack_micro_batch(
        random_batch(vocab_size=64, prompt_lengths=(1, 2, 1), response_lengths=(2, 3, 1), seed=0).to("cuda"),
        LENGTHS,
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**packed_row_kwargs(row))
    finally:
        torch.cuda.set_sync_debug_mode("default")
