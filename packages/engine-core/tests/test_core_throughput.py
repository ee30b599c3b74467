"""The FLOP counter against a hand count, the peak lookup, the perf metrics and the one-read host floats."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from drivetrain_engine_core._throughput import (
    PEAK_TFLOPS_VARIABLE,
    TransformerShape,
    peak_tflops,
    speed_metrics,
    table_peak_tflops,
)
from drivetrain_engine_core.backend import host_floats
from drivetrain_engine_core.testing.models import MOE_CONFIGS, TINY_CONFIG
from transformers import AutoConfig, AutoModelForCausalLM

TINY = SimpleNamespace(
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)


def test_flops_of_a_tiny_config_match_a_hand_count():
    shape = TransformerShape.from_hf_config(TINY)
    assert shape is not None
    # Per layer: q 8x8, k and v 8x4 each, o 8x8, gated MLP 3 x 8x16 = 64 + 64 + 64 + 384 = 576; head 8x10.
    assert shape.matmul_weights == 2 * 576 + 80
    # Matmuls 2 * 1232 * 8 tokens; causal attention 2 * layers * heads * head_dim * (3^2 + 5^2).
    assert shape.forward_flops([3, 5]) == 2 * 1232 * 8 + 2 * 2 * 2 * 4 * 34
    assert shape.step_flops([3, 5], backward=True) == 3 * 20800
    assert shape.step_flops([3, 5], backward=False) == 20800


def test_a_value_models_head_is_one_column_not_the_vocabulary():
    """A critic's or reward model's head is ``H x 1``; counting ``H x V`` overstated a value model's FLOPs and MFU
    (by 1.38x at the 0.5B shape with its 152k vocabulary)."""
    shape = TransformerShape.from_hf_config(TINY, value_head=True)
    assert shape is not None and shape.matmul_weights == 2 * 576 + 8


def test_unknown_expert_layouts_and_incomplete_configs_have_no_shape():
    assert TransformerShape.from_hf_config(SimpleNamespace(**vars(TINY), num_experts=8)) is None  # no top-k
    deepseek = SimpleNamespace(**vars(TINY), n_routed_experts=8, num_experts_per_tok=2)
    assert TransformerShape.from_hf_config(deepseek) is None
    assert TransformerShape.from_hf_config(SimpleNamespace(hidden_size=8)) is None


def test_mixture_of_experts_counts_the_active_experts_by_hand():
    """A token goes through its top-k experts only: counting all of them overstated FLOPs and MFU E / k-fold."""
    moe = SimpleNamespace(
        **vars(TINY), num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, mlp_only_layers=[1]
    )
    shape = TransformerShape.from_hf_config(moe)
    # Attention 192 per layer (as above). Layer 0 routed: router 8x8 + 2 experts x 3 x 8x4 = 64 + 192;
    # layer 1 dense (mlp_only_layers): 3 x 8x16 = 384. Head 8x10.
    assert shape is not None and shape.matmul_weights == 2 * 192 + 256 + 384 + 80
    shared = TransformerShape.from_hf_config(SimpleNamespace(**vars(moe), shared_expert_intermediate_size=6))
    # Qwen2-MoE's shared expert 3 x 8x6 and its gate 8x1 in the routed layer.
    assert shared is not None and shared.matmul_weights == shape.matmul_weights + 144 + 8
    mixtral = TransformerShape.from_hf_config(
        SimpleNamespace(**vars(TINY), num_local_experts=4, num_experts_per_tok=2)
    )
    # Every layer routed, experts of intermediate_size: router 8x4 + 2 x 3 x 8x16.
    assert mixtral is not None and mixtral.matmul_weights == 2 * (192 + 32 + 768) + 80


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_mixture_of_experts_count_is_the_models_matrices_with_experts_weighted_k_of_e(arch):
    """Against the model itself: every matrix but the embedding, each expert's weighted by ``k / E`` (the
    share of tokens an expert multiplies on average)."""
    config = AutoConfig.for_model(arch, **TINY_CONFIG, **MOE_CONFIGS[arch], vocab_size=50)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    share = Fraction(config.num_experts_per_tok, experts)
    expected = sum(
        parameter.numel() * (share if ".experts." in name else 1)
        for name, parameter in model.named_parameters()
        if parameter.dim() > 1 and "embed_tokens" not in name
    )
    shape = TransformerShape.from_hf_config(config)
    assert shape is not None and shape.matmul_weights == expected


def test_peak_comes_from_config_then_environment_then_nothing_on_cpu(monkeypatch):
    monkeypatch.delenv(PEAK_TFLOPS_VARIABLE, raising=False)
    assert peak_tflops("cpu", None) is None
    assert peak_tflops("cpu", 2.5) == 2.5
    monkeypatch.setenv(PEAK_TFLOPS_VARIABLE, "0.5")
    assert peak_tflops("cpu", None) == 0.5
    assert peak_tflops("cpu", 2.5) == 2.5
    monkeypatch.setenv(PEAK_TFLOPS_VARIABLE, "fast")
    with pytest.raises(ValueError, match=PEAK_TFLOPS_VARIABLE):
        peak_tflops("cpu", None)


def test_a_float32_run_is_not_measured_against_the_half_precision_peak(monkeypatch):
    """The table's peaks are bf16/fp16; float32 matmuls reach half of it in TF32 and far less at full precision
    (torch's default), where the table's peak made MFU look several times worse than it was."""
    monkeypatch.delenv(PEAK_TFLOPS_VARIABLE, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert peak_tflops("cuda", None, "bfloat16") == 989.0
    assert peak_tflops("cuda", None, "float32") is None
    assert peak_tflops("cuda", 60.0, "float32") == 60.0
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_tflops("cuda", None, "float32") == 494.5


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),  # was matched as "H100": MFU understated by a quarter
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_peak_table_tells_variants_of_a_family_apart(device_name, peak):
    assert table_peak_tflops(device_name) == peak


def test_speed_metrics():
    metrics = speed_metrics(
        seconds=2.0, tokens=1000.0, flops=8e12, devices=2, peak=4.0, device_peak_bytes=1 << 30
    )
    assert metrics == {
        "perf/step_time_s": 2.0,
        "perf/tokens": 1000.0,
        "perf/tokens_per_s": 500.0,
        "perf/tflops_per_device": 2.0,
        "perf/mfu": 0.5,
        "perf/device_peak_gib": 1.0,
    }
    assert "perf/mfu" not in speed_metrics(
        seconds=1.0, tokens=1.0, flops=1.0, devices=1, peak=None, device_peak_bytes=None
    )


def test_host_floats_keep_order_across_tensors_and_numbers():
    assert host_floats([1.5, torch.tensor(2.0), 3, torch.tensor([4.0])]) == [1.5, 2.0, 3.0, 4.0]
