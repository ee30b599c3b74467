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
from drivetrain_ckpt_tools.merge import MergeOptions, merge_checkpoint
from drivetrain_engine_core._data.rows import select_rows
from drivetrain_engine_core._data.tokens import local_token_count
from drivetrain_engine_core.backend import ConfigError, LoraConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import LossContext, MicroBatchConfig
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
from drivetrain_engine_core.testing.reference import grad_norm, load_reference_model, reference_outputs
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from drivetrain_engine_fsdp.router_loss import METRIC, RouterLoss, router_settings
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
OPTIMIZER = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0)
WEIGHTS = "model.safetensors"
# Attention only: PEFT's adapters on fused experts (not nn.Linear) are refused, as export and merge fold
# nn.Linear adapters only.
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj"))
COEFFICIENT = 0.5  # large enough that the balance loss moves the grad norm well past the tolerance


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: make_tiny_model_dir(root / arch, arch=arch) for arch in ARCHS}


def make_engine(path, *, optimizer=OPTIMIZER, lora=None, **engine):
    engine.setdefault("device", device_under_test())
    engine.setdefault("micro_batch", MicroBatchConfig(micro_batch_size=2))
    instance = FSDPEngine(
        model_config=ModelConfig(path=str(path), lora=lora),
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


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_buckets_and_checkpoint_merge_write_the_trained_experts_in_checkpoint_layout(
    model_dirs, tmp_path, lora
):
    """After a step, the hand-off's buckets and ``ckpt merge`` (LoRA folded in) carry what export yields, per
    expert, and ``from_pretrained`` of the merged directory holds the engine's (fused) weights bit for bit."""
    path = model_dirs["qwen3_moe"]
    engine = make_engine(path, lora=lora)
    train_history(engine, make_batches(1), token_mean_nll)
    expected = exported(engine)
    assert sorted(expected) == sorted(load_file(path / WEIGHTS))
    buckets = {
        n: t.cpu().clone()
        for b in engine.weight_buckets(version=1, bucket_bytes=4096)
        for n, t in b.tensors()
    }
    assert_bit_equal(buckets, expected)
    engine.save_checkpoint(tmp_path / "ckpt", global_step=1)
    merge_checkpoint(tmp_path / "ckpt", tmp_path / "merged", MergeOptions(merge_lora=lora is not None))
    merged = load_file(tmp_path / "merged" / WEIGHTS)
    if lora is not None and device_under_test() != "cpu":
        # The merge folds B @ A on the CPU, the engine on its accelerator (other kernels, other rounding): the
        # conformance kit's convention for merged adapters (`merge_tolerance`), bit for bit on cpu.
        assert sorted(merged) == sorted(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    else:
        assert_bit_equal(merged, expected)
    if lora is None:
        assert_bit_equal(full_state(engine.module), reference_state(tmp_path / "merged"))


class AuxRecorder(torch.nn.Module):
    """The plain model asked for its router logits; keeps the ``aux_loss`` transformers computes for each call."""

    def __init__(self, model):
        super().__init__()
        self.model, self.aux = model, []

    def forward(self, **kwargs):
        output = self.model(**kwargs, output_router_logits=True)
        self.aux.append(output.aux_loss)
        return output


def reference_step_with_aux(path, batch, coefficient):
    """``(loss, aux, grad norm)`` of plain HF: token-mean NLL plus ``coefficient`` times transformers'
    ``load_balancing_loss_func`` of each sequence alone (the reference runs one sequence per call), averaged."""
    recorder = AuxRecorder(load_reference_model(path))
    outputs = reference_outputs(recorder, batch, "language_model")
    context = LossContext(global_token_count=local_token_count(batch), global_sequence_count=len(batch))
    nll, _ = token_mean_nll(outputs, batch, context)
    assert len(recorder.aux) == len(batch)
    aux = torch.stack(recorder.aux).mean()
    loss = nll + coefficient * aux
    loss.backward()
    return float(loss.detach()), float(aux.detach()), grad_norm(list(recorder.model.parameters()))


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_router_aux_loss_is_hf_per_sequence_whatever_the_micro_batching(model_dirs, arch):
    path, batch = model_dirs[arch], make_batches(1)[0]
    loss, aux, norm = reference_step_with_aux(path, batch, COEFFICIENT)
    # Fixed micro-batches of 4 and 2 sequences, and dynamic ones of at most 8 tokens (sequences of 7, 7, 8, 7).
    splits = [
        (1, MicroBatchConfig(micro_batch_size=4)),
        (2, MicroBatchConfig(micro_batch_size=2)),
        (4, MicroBatchConfig(micro_batch_size=None, max_tokens=8)),
    ]
    for count, micro_batch in splits:
        engine = make_engine(path, router_aux_loss_coef=COEFFICIENT, micro_batch=micro_batch)
        with engine.train_mode():
            output = engine.train_batch(batch, token_mean_nll)
        shares = output.metrics[METRIC]
        assert len(shares) == count
        assert sum(shares) == pytest.approx(aux, rel=1e-5)
        assert output.loss == pytest.approx(loss, rel=1e-5)
        assert output.metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_the_coefficient_follows_the_models_config_unless_set(model_dirs):
    routed = AutoConfig.from_pretrained(model_dirs["qwen3_moe"])
    lm = "language_model"
    assert router_settings(FSDPEngineConfig(), routed, lm, 1) == RouterLoss(coefficient=0.0, top_k=2)
    routed.output_router_logits = True  # transformers' own training then adds router_aux_loss_coef * aux
    assert router_settings(FSDPEngineConfig(), routed, lm, 1) == RouterLoss(coefficient=0.001, top_k=2)
    assert router_settings(FSDPEngineConfig(router_aux_loss_coef=0.0), routed, lm, 1).coefficient == 0.0
    assert router_settings(FSDPEngineConfig(router_aux_loss_coef=0.0), routed, lm, 2) is None
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2"):
        router_settings(FSDPEngineConfig(router_aux_loss_coef=0.1), routed, lm, 2)
    assert router_settings(FSDPEngineConfig(), routed, "value_model", 1) is None
    dense = AutoConfig.for_model("qwen2")
    assert router_settings(FSDPEngineConfig(), dense, lm, 1) is None
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0.1 .* Qwen2Config as a language_model"):
        router_settings(FSDPEngineConfig(router_aux_loss_coef=0.1), dense, lm, 1)
    with pytest.raises(ConfigError, match="router_aux_loss_coef must be >= 0"):
        FSDPEngineConfig(router_aux_loss_coef=-1.0)


def two_rank_worker(rank, world_size, path, device):
    """Each rank holds sequences ``rank`` and ``rank + 2`` of every batch."""
    batches = [select_rows(batch, torch.tensor([rank, rank + 2])) for batch in make_batches()]
    engine = make_engine(path, device=device)
    routed = make_engine(path, device=device, router_aux_loss_coef=COEFFICIENT)
    with routed.train_mode():
        step = routed.train_batch(batches[0], token_mean_nll)
    return {
        "state": full_state(engine.module),
        "log_probs": log_probs(engine, batches[0]),
        "history": train_history(engine, batches, token_mean_nll),
        "exported": sorted(name for name, _ in engine.export_weights()),
        "local": sum(p.to_local().numel() for p in engine.module.parameters()),
        "aux_step": (step.loss, sum(step.metrics[METRIC]), step.metrics["grad_norm"]),
    }


@pytest.mark.slow
def test_two_ranks_load_shard_train_and_export_like_plain_hf(model_dirs):
    path = model_dirs["qwen3_moe"]
    results = run_distributed(two_rank_worker, str(path), "cpu", world_size=2, timeout_s=600, device="cpu")
    reference = reference_state(path)
    batches = make_batches()
    expected_history = reference_train_losses(path, batches, OPTIMIZER, token_mean_nll)
    loss, aux, norm = reference_step_with_aux(path, batches[0], COEFFICIENT)
    # Rank 0 holds sequences 0 and 2, rank 1 sequences 1 and 3.
    produced_log_probs = torch.cat([results[0]["log_probs"], results[1]["log_probs"]])
    expected_log_probs = reference_log_probs(
        path, select_rows(batches[0], torch.tensor([0, 2, 1, 3]))
    ).values()
    assert float((produced_log_probs - expected_log_probs).abs().max()) < 1e-5
    for result in results:
        assert_bit_equal(result["state"], reference)
        assert flat(result["history"]) == pytest.approx(flat(expected_history), rel=1e-5)
        assert result["exported"] == sorted(load_file(path / WEIGHTS))
        trainable = sum(t.numel() for t in reference.values() if t.requires_grad)
        assert result["local"] == pytest.approx(trainable / 2, rel=0.05)
        assert result["aux_step"][0] == pytest.approx(loss, rel=1e-5)
        assert result["aux_step"][2] == pytest.approx(norm, rel=1e-5)
    assert results[0]["aux_step"][1] + results[1]["aux_step"][1] == pytest.approx(aux, rel=1e-5)
