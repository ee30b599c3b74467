"""The CUDA-only fast paths agree with the exact ones: torch's varlen flash attention against SDPA per sequence,
and Liger's fused linear cross-entropy against the chunked torch log-probs (values and gradients, bf16).

The agreement tests run in the GPU lane. On CPU: the refusals, and the varlen call as each torch release
spells it, against a stand-in kernel of that signature.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
import torch.nn.functional as F
from drivetrain_engine_core.backend import ForwardOptions, linear_log_probs
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_engine_fsdp.attention import varlen_attention_forward
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.liger import liger_applies

LENGTHS = (5, 130, 1, 64)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


class _Attention(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def _per_sequence_reference(query, key, value):
    """Causal SDPA on each sequence alone, in float32, key/value repeated to the query's heads."""
    outputs, start = [], 0
    for length in LENGTHS:
        q, k, v = (t[:, :, start : start + length].float() for t in (query, key, value))
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        start += length
    return torch.cat(outputs, dim=2).transpose(1, 2)


@requires_cuda
def test_varlen_flash_attention_matches_sdpa_per_sequence():
    generator = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    shapes = ((1, HEADS, total, HEAD_DIM), (1, KV_HEADS, total, HEAD_DIM), (1, KV_HEADS, total, HEAD_DIM))
    query, key, value = (
        torch.randn(s, generator=generator, device="cuda").bfloat16().requires_grad_() for s in shapes
    )
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    output, _ = varlen_attention_forward(
        _Attention(), query, key, value, None, cu_seq_lens_q=cu, max_length_q=max(LENGTHS),
        sequence_lengths=LENGTHS, scaling=HEAD_DIM**-0.5,
    )  # fmt: skip
    reference = _per_sequence_reference(query, key, value)
    # bf16 inputs and output: within a few bf16 ulps of the float32 reference.
    torch.testing.assert_close(output.float(), reference, atol=2e-2, rtol=2e-2)
    weights = torch.randn(reference.shape, generator=generator, device="cuda")
    got = torch.autograd.grad((output.float() * weights).sum(), (query, key, value))
    expected = torch.autograd.grad((reference * weights).sum(), (query, key, value))
    for grad, ref in zip(got, expected, strict=True):
        assert float((grad.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@requires_cuda
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger_kernel is not installed")
def test_liger_log_probs_match_the_chunked_torch_path():
    from drivetrain_engine_fsdp.liger import liger_log_probs

    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens, hidden_size, vocab = 3000, 256, 32_000
    hidden = torch.randn(tokens, hidden_size, generator=generator, device="cuda").bfloat16()
    weight = (
        torch.randn(vocab, hidden_size, generator=generator, device="cuda") / hidden_size**0.5
    ).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device="cuda")
    upstream = torch.randn(tokens, generator=generator, device="cuda") / tokens

    def run(compute):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        log_probs = compute(h, w)
        return (log_probs, *torch.autograd.grad((log_probs * upstream).sum(), (h, w)))

    expected = run(
        lambda h, w: linear_log_probs(h, w, labels, temperature=1.0, compute_entropy=False, chunk_size=1024)[
            0
        ]
    )
    got = run(lambda h, w: liger_log_probs(h, w, labels, temperature=1.0, chunk_size=1024))
    # Same bf16 logits, float32 softmax in both: the log-probs agree to float32 rounding of O(10) numbers;
    # bf16 gradients to a few bf16 ulps.
    torch.testing.assert_close(got[0], expected[0], atol=2e-3, rtol=0)
    for grad, ref in zip(got[1:], expected[1:], strict=True):
        assert grad.dtype == torch.bfloat16
        assert float((grad.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_liger_computes_only_what_it_can_compute_like_the_torch_path():
    """Entropy, and a temperature folded into bf16 hidden states (off by up to 2e-2 on an H100), take the
    torch path; log-probs at temperature 1, or any temperature in float32, take Liger's."""
    assert liger_applies(ForwardOptions(temperature=1.0), torch.bfloat16)
    assert liger_applies(ForwardOptions(temperature=0.7), torch.float32)
    assert not liger_applies(ForwardOptions(temperature=0.7), torch.bfloat16)
    assert not liger_applies(ForwardOptions(compute_entropy=True), torch.float32)


def test_liger_kernel_is_refused_on_cpu():
    with pytest.raises(ConfigError, match="log_prob_kernel='liger' runs Triton kernels on CUDA only"):
        FSDPEngineConfig(device="cpu", log_prob_kernel="liger")


def test_unknown_log_prob_kernel_is_refused():
    with pytest.raises(
        ConfigError, match="log_prob_kernel='triton' is not supported; choose 'torch' or 'liger'"
    ):
        FSDPEngineConfig(device="cpu", log_prob_kernel="triton")


def _attend(query, key, value, cu_seq_q, *, causal, scale=None, enable_gqa=False):
    """What the kernel computes, on CPU: causal attention per sequence of ``(T, heads, head_dim)`` inputs."""
    assert causal
    assert enable_gqa or key.shape[1] == query.shape[1], "without enable_gqa key/value must be repeated"
    bounds = cu_seq_q.tolist()
    pieces = [
        F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (query, key, value)),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        ).transpose(0, 1)
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(pieces)


def varlen_before_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _attend(query, key, value, cu_seq_q, causal=is_causal)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):  # fmt: skip
    return _attend(query, key, value, cu_seq_q, causal=window_size == (-1, 0), scale=scale)


def varlen_after_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    return _attend(
        query, key, value, cu_seq_q, causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa
    )


@pytest.mark.parametrize("kernel", [varlen_before_2_11, varlen_2_11, varlen_after_2_11])
def test_varlen_call_is_spelled_for_each_torch_release(monkeypatch, kernel):
    from drivetrain_engine_fsdp import attention

    monkeypatch.setattr(attention.varlen, "varlen_attn", kernel)
    attention._varlen_keywords.cache_clear()
    try:
        generator = torch.Generator().manual_seed(0)
        total = sum(LENGTHS)
        query = torch.randn(1, HEADS, total, HEAD_DIM, generator=generator)
        key, value = (torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=generator) for _ in range(2))
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        got = attention._torch_varlen(query, key, value, cu, max(LENGTHS), HEAD_DIM**-0.5, HEADS // KV_HEADS)
    finally:
        attention._varlen_keywords.cache_clear()
    torch.testing.assert_close(got[0], _per_sequence_reference(query, key, value)[0], atol=1e-5, rtol=1e-5)
