"""One-rank FSDP engine against a plain single-process Hugging Face reference (core's testing.reference)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from drivetrain_engine_core.config import (
    ConfigError,
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
)
from drivetrain_engine_core.data.options import set_forward_options
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_entropy,
    reference_log_probs,
    reference_loss_and_grad_norm,
    reference_train_losses,
    reference_values,
    token_mean_nll,
    value_mse,
)
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from transformers import AutoModelForCausalLM

VOCAB = 100
PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
OPTIMIZER = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": make_tiny_model_dir(root / "qwen2", arch="qwen2"),
        "llama": make_tiny_model_dir(root / "llama", arch="llama"),
        "value": make_tiny_model_dir(root / "value", arch="qwen2", model_type="value_model"),
    }


def make_engine(
    path, *, model_type="language_model", lora=None, use_remove_padding=True, optimizer=OPTIMIZER, **engine
):
    engine.setdefault("micro_batch", MicroBatchConfig(micro_batch_size=2))
    model = ModelConfig(
        path=str(path), model_type=model_type, lora=lora, use_remove_padding=use_remove_padding
    )
    instance = FSDPEngine(
        model_config=model, engine_config=FSDPEngineConfig(**engine), optimizer_config=optimizer
    )
    instance.initialize()
    return instance


def make_batch(seed=0, with_returns=False):
    return random_batch(
        vocab_size=VOCAB,
        prompt_lengths=PROMPTS,
        response_lengths=RESPONSES,
        seed=seed,
        with_returns=with_returns,
    )


def max_diff(jagged_a, jagged_b):
    return float((jagged_a.values() - jagged_b.values()).abs().max())


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("use_remove_padding", [True, False])
def test_log_probs_and_entropy_match_reference(model_dirs, arch, use_remove_padding):
    engine = make_engine(model_dirs[arch], use_remove_padding=use_remove_padding, entropy_chunk_size=5)
    batch = set_forward_options(make_batch(), temperature=0.7, compute_entropy=True)
    with engine.eval_mode():
        outputs = engine.infer_batch(batch).outputs
    assert (
        max_diff(outputs["log_probs"], reference_log_probs(model_dirs[arch], batch, temperature=0.7)) < 1e-5
    )
    assert max_diff(outputs["entropy"], reference_entropy(model_dirs[arch], batch, temperature=0.7)) < 1e-5
    first_positions = outputs["log_probs"].offsets()[:-1]
    assert torch.all(outputs["log_probs"].values()[first_positions] == 0)


def test_values_match_reference(model_dirs):
    engine = make_engine(model_dirs["value"], model_type="value_model")
    batch = make_batch(with_returns=True)
    with engine.eval_mode():
        outputs = engine.infer_batch(batch).outputs
    assert max_diff(outputs["values"], reference_values(model_dirs["value"], batch)) < 1e-5


VARIANTS = {
    "packed": {},
    "padded": {"use_remove_padding": False},
    "dynamic": {"micro_batch": MicroBatchConfig(micro_batch_size=None, max_tokens=16)},
    "offload": {"param_offload": True, "optimizer_offload": True},
    "cpu_offload_policy": {"cpu_offload_policy": True, "reshard_after_forward": False},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_first_step_loss_and_grad_norm_match_reference(model_dirs, variant):
    engine = make_engine(model_dirs["qwen2"], **VARIANTS[variant])
    batch = make_batch(seed=3)
    with engine.train_mode():
        output = engine.train_batch(batch, token_mean_nll)
    loss, norm = reference_loss_and_grad_norm(model_dirs["qwen2"], batch, token_mean_nll)
    assert output.loss == pytest.approx(loss, rel=1e-5)
    assert output.metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_value_model_first_step_matches_reference(model_dirs):
    engine = make_engine(model_dirs["value"], model_type="value_model")
    batch = make_batch(seed=4, with_returns=True)
    with engine.train_mode():
        output = engine.train_batch(batch, value_mse)
    loss, norm = reference_loss_and_grad_norm(model_dirs["value"], batch, value_mse, model_type="value_model")
    assert output.loss == pytest.approx(loss, rel=1e-5)
    assert output.metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_five_step_loss_curve_matches_reference(model_dirs):
    optimizer = dataclasses.replace(OPTIMIZER, warmup_steps=2)
    engine = make_engine(model_dirs["llama"], optimizer=optimizer)
    batches = [make_batch(seed=10)] * 5  # one batch repeated: the curve must go down
    history = []
    with engine.train_mode():
        for batch in batches:
            output = engine.train_batch(batch, token_mean_nll)
            engine.lr_scheduler_step()
            history.append((output.loss, output.metrics["grad_norm"]))
    reference = reference_train_losses(model_dirs["llama"], batches, optimizer, token_mean_nll)
    for (loss, norm), (ref_loss, ref_norm) in zip(history, reference, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
    assert history[-1][0] < history[0][0]


def run_steps(engine, seeds):
    losses = []
    with engine.train_mode():
        for seed in seeds:
            losses.append(engine.train_batch(make_batch(seed=seed), token_mean_nll).loss)
            engine.lr_scheduler_step()
    return losses


def test_save_load_continue_is_bit_exact(model_dirs, tmp_path):
    engine = make_engine(model_dirs["qwen2"], optimizer=dataclasses.replace(OPTIMIZER, warmup_steps=3))
    run_steps(engine, [20, 21])
    engine.save_checkpoint(tmp_path, global_step=2, extra_state={"epoch": 1})
    expected = run_steps(engine, [22, 23])
    resumed = make_engine(model_dirs["qwen2"], optimizer=dataclasses.replace(OPTIMIZER, warmup_steps=3))
    assert resumed.load_checkpoint(tmp_path) == {"global_step": 2, "epoch": 1}
    assert run_steps(resumed, [22, 23]) == expected
    for (name, tensor), (_, other) in zip(engine.export_weights(), resumed.export_weights(), strict=True):
        assert torch.equal(tensor, other), name
    manifest = json.loads((tmp_path / "global_step_2" / "manifest.json").read_text())
    assert manifest["backend_info"]["hf_class"] == "Qwen2ForCausalLM"
    assert manifest["backend_info"]["state_dict_format"] == "dcp"


def test_export_weights_are_the_hf_state_dict(model_dirs):
    engine = make_engine(model_dirs["llama"], optimizer=None)
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).state_dict()
    exported = dict(engine.export_weights())
    assert sorted(exported) == sorted(reference)
    assert all(torch.equal(exported[name], reference[name]) for name in reference)


LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))


def test_lora_disable_adapter_and_merged_export(model_dirs):
    engine = make_engine(model_dirs["qwen2"], lora=LORA)
    batch = make_batch(seed=5)
    with engine.train_mode():
        for seed in (6, 7):
            engine.train_batch(make_batch(seed=seed), token_mean_nll)
    with engine.eval_mode():
        adapted = engine.infer_batch(batch).outputs["log_probs"]
        with engine.disable_adapter():
            base = engine.infer_batch(batch).outputs["log_probs"]
    assert max_diff(base, reference_log_probs(model_dirs["qwen2"], batch)) < 1e-5
    assert max_diff(adapted, base) > 1e-3  # the adapters were trained
    merged = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32)
    exported = dict(engine.export_weights())
    assert sorted(exported) == sorted(merged.state_dict())
    merged.load_state_dict(exported)
    merged_dir = model_dirs["qwen2"].parent / "merged"
    merged.save_pretrained(merged_dir)
    assert max_diff(adapted, reference_log_probs(merged_dir, batch)) < 1e-5


def test_bad_configs_name_the_fix(model_dirs, tmp_path):
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size"):
        FSDPEngineConfig(ulysses_sequence_parallel_size=0)
    with pytest.raises(ConfigError, match="only one"):
        FSDPEngineConfig(cpu_offload_policy=True, param_offload=True)
    with pytest.raises(ConfigError, match="does not divide"):
        FSDPEngineConfig(ulysses_sequence_parallel_size=3).check_world(2)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        make_engine(tmp_path)


def test_non_finite_grad_norm_skips_the_update(model_dirs):
    engine = make_engine(model_dirs["qwen2"])
    before = dict(engine.export_weights())

    def poisoned(model_output, batch, context):
        loss, metrics = token_mean_nll(model_output, batch, context)
        return loss * float("nan"), metrics

    with engine.train_mode():
        output = engine.train_batch(make_batch(), poisoned)
    assert math.isnan(output.metrics["grad_norm"])
    assert engine.skipped_steps == 1
    assert all(torch.equal(before[name], tensor) for name, tensor in engine.export_weights())
