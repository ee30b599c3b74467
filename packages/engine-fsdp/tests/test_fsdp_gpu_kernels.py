"""Liger's fused linear cross-entropy agrees with the chunked torch log-probs (values and gradients, bf16), and
a float32 model under bf16 autocast attends with the varlen flash kernel.

The CUDA tests run in the GPU lane; on CPU, what takes which path and the refusals. (The varlen flash
attention's own tests are core's: ``test_core_packed_attention.py``.)
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError, ForwardOptions
from drivetrain_engine_core.kit import linear_log_probs
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.liger import liger_applies


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


@requires_cuda
def test_float32_weights_under_bf16_autocast_attend_with_the_flash_kernel(monkeypatch):
    """The GPU benchmark's bare loop: float32 weights, bf16 autocast, the varlen attention. Rotary gives float32
    query/key there; packed attention casts them to bf16, so every layer takes torch's varlen flash kernel and
    none SDPA (the H100 figures taken before that cast timed a bare loop whose attention ran the math kernel)."""
    from drivetrain_engine_core import _packed_attention as packed_attention
    from drivetrain_engine_core._data.packing import pack_micro_batch
    from drivetrain_engine_core.testing import random_batch
    from drivetrain_engine_fsdp.attention import register_varlen_attention
    from drivetrain_engine_fsdp.inputs import packed_row_kwargs
    from transformers import AutoConfig, AutoModelForCausalLM

    flash_inputs = []
    flash = packed_attention._torch_varlen

    def counted_flash(query, *args, **kwargs):
        flash_inputs.append(query.dtype)
        return flash(query, *args, **kwargs)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("packed attention took an SDPA path, not the flash kernel")

    monkeypatch.setattr(packed_attention, "_torch_varlen", counted_flash)
    monkeypatch.setattr(packed_attention, "_padded_sdpa", no_sdpa)
    monkeypatch.setattr(packed_attention, "_per_sequence_sdpa", no_sdpa)
    config = AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=register_varlen_attention()
    ).cuda()
    batch = random_batch(vocab_size=64, prompt_lengths=(40, 3), response_lengths=(60, 5), seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**packed_row_kwargs(pack_micro_batch(batch.to("cuda"), (100, 8))))
    assert flash_inputs == [torch.bfloat16] * config.num_hidden_layers


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
