"""Mixture-of-experts models on the FSDP engine against plain Hugging Face (transformers 5's fused experts).

transformers builds Qwen3-MoE, Qwen2-MoE and Mixtral with their experts fused (``mlp.experts.gate_up_proj``) while
their checkpoints hold one tensor per expert (``mlp.experts.N.gate_proj.weight``; Mixtral's also under other
names). The references are what a user writes without drivetrain: ``from_pretrained`` for the weights, log-probs
and training steps, and the ``model.safetensors`` that ``save_pretrained`` wrote for the layout of every export.
One 2-rank launch runs every 2-rank check.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_ckpt_tools.merge import merge_checkpoint
from drivetrain_engine_core.config import MicroBatchConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_log_probs,
    reference_train_losses,
    run_distributed,
    token_mean_nll,
    train_history,
)
from drivetrain_engine_core.testing.device import device_under_test
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
OPTIMIZER = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model_dir(root / arch, arch=arch) for arch in ARCHS}


def make_engine(path, *, optimizer=OPTIMIZER, **engine):
    engine.setdefault("device", device_under_test())
    engine.setdefault("micro_batch", MicroBatchConfig(micro_batch_size=2))
    instance = FSDPEngine(
        model_config=ModelConfig(path=str(path)),
        engine_config=FSDPEngineConfig(**engine),
        optimizer_config=optimizer,
    )
    instance.initialize()
    return instance


def make_batches(count=2):
    return [
        random_batch(vocab_size=100, prompt_lengths=[3, 5, 2, 4], response_lengths=[4, 2, 6, 3], seed=seed)
        for seed in range(count)
    ]


def full_state(module):
    """Every parameter and buffer as a full CPU tensor (a collective when sharded)."""
    return {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }


def reference_state(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()]}


def assert_bit_equal(produced, reference):
    assert sorted(produced) == sorted(reference)
    for name, tensor in reference.items():
        assert produced[name].dtype == tensor.dtype and torch.equal(produced[name], tensor), name


def log_probs(engine, batch):
    with engine.eval_mode():
        return engine.infer_batch(batch).outputs["log_probs"].values().cpu()


def flat(history):
    """``[(loss, grad norm), ...]`` as one list of numbers, for ``pytest.approx``."""
    return [number for step in history for number in step]


def exported(engine):
    return {name: tensor.detach().cpu().clone() for name, tensor in engine.export_weights()}


@pytest.mark.parametrize(
    ("arch", "meta_init"),
    [*((arch, True) for arch in ARCHS), ("qwen3_moe", False)],
    ids=[*ARCHS, "full_path"],
)
def test_weights_equal_from_pretrained_and_export_is_the_checkpoint(model_dirs, arch, meta_init):
    """The fused experts are joined as ``from_pretrained`` joins them, and export writes them back per expert:
    the same names and bytes as the ``save_pretrained`` file."""
    engine = make_engine(model_dirs[arch], optimizer=None, meta_init=meta_init)
    assert_bit_equal(full_state(engine.module), reference_state(model_dirs[arch]))
    assert_bit_equal(exported(engine), load_file(model_dirs[arch] / WEIGHTS))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_log_probs_and_training_steps_equal_plain_hf(model_dirs, arch):
    path, batches = model_dirs[arch], make_batches()
    engine = make_engine(path)
    assert (
        float((log_probs(engine, batches[0]) - reference_log_probs(path, batches[0]).values()).abs().max())
        < 1e-5
    )
    produced = train_history(engine, batches, token_mean_nll)
    expected = reference_train_losses(path, batches, OPTIMIZER, token_mean_nll)
    assert flat(produced) == pytest.approx(flat(expected), rel=1e-5)


def test_checkpoint_merge_writes_the_trained_experts_in_checkpoint_layout(model_dirs, tmp_path):
    """After a step, ``ckpt merge`` writes what export yields, per expert, and ``from_pretrained`` of the merged
    directory holds the engine's (fused) weights bit for bit."""
    path = model_dirs["qwen3_moe"]
    engine = make_engine(path)
    train_history(engine, make_batches(1), token_mean_nll)
    engine.save_checkpoint(tmp_path / "ckpt", global_step=1)
    merge_checkpoint(tmp_path / "ckpt", tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / WEIGHTS)
    assert sorted(merged) == sorted(load_file(path / WEIGHTS))
    assert_bit_equal(merged, exported(engine))
    assert_bit_equal(full_state(engine.module), reference_state(tmp_path / "merged"))


def two_rank_worker(rank, world_size, path, device):
    engine = make_engine(path, device=device)
    batches = make_batches()
    return {
        "state": full_state(engine.module),
        "log_probs": log_probs(engine, batches[0]),
        "history": train_history(engine, batches, token_mean_nll),
        "exported": exported(engine),
        "local": sum(p.to_local().numel() for p in engine.module.parameters()),
    }


@pytest.mark.slow
def test_two_ranks_load_shard_train_and_export_like_plain_hf(model_dirs):
    path = model_dirs["qwen3_moe"]
    results = run_distributed(two_rank_worker, str(path), "cpu", world_size=2, timeout_s=600, device="cpu")
    reference = reference_state(path)
    batches = make_batches()
    expected_log_probs = reference_log_probs(path, batches[0]).values()
    expected_history = reference_train_losses(path, batches, OPTIMIZER, token_mean_nll)
    for result in results:
        assert_bit_equal(result["state"], reference)
        assert float((result["log_probs"] - expected_log_probs).abs().max()) < 1e-5
        assert flat(result["history"]) == pytest.approx(flat(expected_history), rel=1e-5)
        assert sorted(result["exported"]) == sorted(load_file(path / WEIGHTS))
        assert result["local"] == pytest.approx(
            sum(t.numel() for t in reference.values() if t.requires_grad) / 2, rel=0.05
        )
