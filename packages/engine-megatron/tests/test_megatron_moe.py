"""Mixture-of-experts models on the megatron backend (sequential expert MLP, one rank) against plain Hugging Face,
and the layouts and settings it refuses. Expert parallelism (2 ranks) is tested against HF and the FSDP engine in
the root `tests/test_moe_across_backends.py`."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_log_probs,
    reference_train_losses,
    token_mean_nll,
    train_history,
)
from safetensors.torch import load_file
from transformers import AutoConfig

OPTIMIZER = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0)


def make_batches(count=2):
    return [
        random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=seed)
        for seed in range(count)
    ]


@pytest.mark.slow
def test_export_log_probs_and_training_steps_equal_plain_hf(tmp_path, arch="qwen3_moe"):
    """Export is the ``save_pretrained`` file (per-expert names, same bytes); log-probs within 1e-5; two AdamW
    steps give plain torch's losses and grad norms."""
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    path = make_tiny_model_dir(tmp_path / arch, arch=arch)
    engine = MegatronEngine(
        model_config=ModelConfig(path=str(path)),
        engine_config=MegatronEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=2)),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    exported = {name: tensor.detach().cpu() for name, tensor in engine.export_weights()}
    on_disk = load_file(path / "model.safetensors")
    assert sorted(exported) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name
    batches = make_batches()
    with engine.eval_mode():
        log_probs = engine.infer_batch(batches[0]).outputs["log_probs"].values()
    assert float((log_probs - reference_log_probs(path, batches[0]).values()).abs().max()) < 1e-5
    produced = [x for step in train_history(engine, batches, token_mean_nll) for x in step]
    expected = [x for step in reference_train_losses(path, batches, OPTIMIZER, token_mean_nll) for x in step]
    assert produced == pytest.approx(expected, rel=1e-5)


def test_sequential_expert_names_are_mbridges_grouped_names():
    from drivetrain_engine_megatron.moe import grouped_expert_name

    assert (
        grouped_expert_name("decoder.layers.3.mlp.experts.local_experts.12.linear_fc1.weight")
        == "decoder.layers.3.mlp.experts.linear_fc1.weight12"
    )
    assert grouped_expert_name("decoder.layers.3.mlp.router.weight") == "decoder.layers.3.mlp.router.weight"


def test_pipeline_parallelism_is_refused_for_mixture_of_experts():
    from drivetrain_engine_megatron import MegatronEngineConfig
    from drivetrain_engine_megatron.moe import moe_overrides

    config = AutoConfig.for_model("qwen3_moe", num_experts=4)
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size=2\).*fsdp backend"):
        moe_overrides(config, MegatronEngineConfig(pipeline_model_parallel_size=2))
    assert (
        moe_overrides(AutoConfig.for_model("qwen2"), MegatronEngineConfig(pipeline_model_parallel_size=2))
        == {}
    )


def test_layouts_not_verified_for_expert_parallelism_are_refused_naming_the_option():
    from drivetrain_engine_megatron import MegatronEngineConfig
    from drivetrain_engine_megatron.moe import moe_overrides

    routed = AutoConfig.for_model("qwen3_moe", num_experts=4)
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=2 with tensor_model_parallel_size=2"):
        moe_overrides(
            routed, MegatronEngineConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2)
        )
    with pytest.raises(ConfigError, match=r"4 experts, .*expert_model_parallel_size=3 .*divides 4"):
        moe_overrides(routed, MegatronEngineConfig(expert_model_parallel_size=3))
    with pytest.raises(ConfigError, match=r"qwen2 has none; set expert_model_parallel_size=1"):
        moe_overrides(AutoConfig.for_model("qwen2"), MegatronEngineConfig(expert_model_parallel_size=2))
    assert moe_overrides(routed, MegatronEngineConfig(expert_model_parallel_size=2))[
        "moe_token_dispatcher_type"
    ] == ("alltoall")
    # The experts split over data-parallel ranks: TP2 on 2 ranks leaves one.
    with pytest.raises(ConfigError, match=r"leaves 1 of them .*launch a multiple of 4 ranks"):
        MegatronEngineConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2).check_world(2)


def test_router_balance_loss_settings_follow_the_model_and_refuse_what_splits_a_sequence():
    from drivetrain_engine_core.kit import RouterLoss
    from drivetrain_engine_megatron import MegatronEngineConfig
    from drivetrain_engine_megatron.router_loss import router_loss_settings

    routed = AutoConfig.for_model(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01
    )
    lm = "language_model"
    assert router_loss_settings(MegatronEngineConfig(), routed, lm, False) == RouterLoss(
        coefficient=0.0, top_k=2
    )
    routed.output_router_logits = True
    assert router_loss_settings(MegatronEngineConfig(), routed, lm, False) == RouterLoss(
        coefficient=0.01, top_k=2
    )
    sequence_parallel = MegatronEngineConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert router_loss_settings(MegatronEngineConfig(router_aux_loss_coef=0.0), routed, lm, True) is None
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0.01 .*sequence_parallel=True"):
        router_loss_settings(sequence_parallel, routed, lm, False)
    with pytest.raises(ConfigError, match=r"gradient_checkpointing=True .*router_aux_loss_coef=0"):
        router_loss_settings(MegatronEngineConfig(router_aux_loss_coef=0.5), routed, lm, True)
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0.5 .* Qwen2Config as a language_model"):
        router_loss_settings(
            MegatronEngineConfig(router_aux_loss_coef=0.5), AutoConfig.for_model("qwen2"), lm, False
        )
    with pytest.raises(ConfigError, match="router_aux_loss_coef must be >= 0"):
        MegatronEngineConfig(router_aux_loss_coef=-1.0)
