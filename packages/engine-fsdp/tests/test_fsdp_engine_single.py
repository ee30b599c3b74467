"""One-rank FSDP engine against a plain single-process Hugging Face reference (core's testing.reference)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings

import pytest
import torch
from drivetrain_engine_core.backend import (
    CheckpointError,
    ConfigError,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
)
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_log_probs,
    reference_loss_and_grad_norm,
    token_mean_nll,
)
from drivetrain_engine_core.testing.device import device_under_test
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 100
PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
OPTIMIZER = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": make_tiny_model_dir(root / "qwen2", arch="qwen2"),
        "llama": make_tiny_model_dir(root / "llama", arch="llama"),
    }


def make_engine(path, *, lora=None, gradient_checkpointing=False, optimizer=OPTIMIZER, **engine):
    engine.setdefault("micro_batch", MicroBatchConfig(micro_batch_size=2))
    engine.setdefault("device", device_under_test())
    model = ModelConfig(path=str(path), lora=lora, gradient_checkpointing=gradient_checkpointing)
    instance = FSDPEngine(
        model_config=model, engine_config=FSDPEngineConfig(**engine), optimizer_config=optimizer
    )
    instance.initialize()
    return instance


def make_batch(seed=0):
    return random_batch(vocab_size=VOCAB, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=seed)


def max_diff(jagged_a, jagged_b):
    """Largest absolute difference, on the CPU: the engine's outputs live on its device, references on the CPU."""
    return float((jagged_a.values().cpu() - jagged_b.values().cpu()).abs().max())


def exported_on_cpu(engine):
    """``export_weights()`` as a dict of CPU tensors, to compare with a Hugging Face model built on the CPU."""
    return {name: tensor.cpu() for name, tensor in engine.export_weights()}


# Layouts the conformance kit does not cover (it checks packed, padded and dynamic micro-batches).
VARIANTS = {
    "offload": {"param_offload": True, "optimizer_offload": True},
    "cpu_offload_policy": {"cpu_offload_policy": True, "reshard_after_forward": False},
    "gradient_checkpointing": {"gradient_checkpointing": True, "entropy_chunk_size": 4},
    "sdpa_attention": {"attention_backend": "sdpa"},
    "defer_gradient_sync": {"defer_gradient_sync": True},
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


def test_resuming_into_a_model_of_another_shape_names_the_tensor_and_both_shapes(model_dirs, tmp_path):
    """A --resume whose model.path named a wider model failed inside DCP's load with a traceback per rank."""
    make_engine(model_dirs["qwen2"]).save_checkpoint(tmp_path / "ckpt", global_step=1)
    wider = make_tiny_model_dir(tmp_path / "wider", arch="qwen2", hidden_size=48)
    saved, now = AutoConfig.from_pretrained(model_dirs["qwen2"]), AutoConfig.from_pretrained(wider)
    assert saved.hidden_size != now.hidden_size == 48
    expected = (
        f"holds model.embed_tokens.weight of shape [{saved.vocab_size}, {saved.hidden_size}], but the model "
        f"being loaded has [{now.vocab_size}, {now.hidden_size}]: the checkpoint was saved from another model "
        f"({model_dirs['qwen2'].resolve()})"
    )
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        make_engine(wider).load_checkpoint(tmp_path / "ckpt")


def test_export_weights_are_the_hf_state_dict(model_dirs):
    engine = make_engine(model_dirs["llama"], optimizer=None)
    reference = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).state_dict()
    exported = exported_on_cpu(engine)
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
    exported = exported_on_cpu(engine)
    assert sorted(exported) == sorted(merged.state_dict())
    merged.load_state_dict(exported)
    merged_dir = model_dirs["qwen2"].parent / "merged"
    merged.save_pretrained(merged_dir)
    assert max_diff(adapted, reference_log_probs(merged_dir, batch)) < 1e-5


def test_lora_on_a_layer_that_is_not_linear_is_refused(model_dirs):
    """PEFT adapts an embedding with ``lora_embedding_A/B`` (no ``.weight``): export raised a KeyError and a
    checkpoint merge wrote the adapters as junk base weights, never folded in. Refused when the model is built."""
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("embed_tokens", "q_proj"))
    with pytest.raises(ConfigError, match=r"not plain linear layers: \['model.embed_tokens \(Embedding\)'\]"):
        make_engine(model_dirs["qwen2"], lora=lora)


def test_lora_on_an_output_layer_tied_to_the_embeddings_is_refused(tmp_path):
    """A merged model holds one matrix for a tied ``lm_head`` and ``embed_tokens``: ``ckpt merge --merge-lora``
    folded the adapter into ``lm_head`` and then skipped it as the tied copy, so the merged model silently lost
    the adapter's update (verify: 3.96 off). Refused when the model is built; untied models keep the option."""
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "lm_head"))
    tied = make_tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True)
    with pytest.raises(
        ConfigError, match=r"adapts the output layer, which this model ties to its input embed"
    ):
        make_engine(tied, lora=lora)
    untied = make_engine(make_tiny_model_dir(tmp_path / "untied"), lora=lora)
    assert any(
        "lm_head.lora_A" in name
        for b in untied.weight_buckets(version=1, lora="adapter")
        for name, _ in b.tensors()
    )


def test_lora_targets_name_the_models_linear_layers_and_take_all_linear(model_dirs):
    """A target that matches nothing (Phi-3's ``qkv_proj`` on a Qwen2) ended in PEFT's traceback; the error now
    lists the model's linear layer names. TRL's ``all-linear`` adapts every projection but the output layer."""
    with pytest.raises(ConfigError, match=r"matches no module .* named \['down_proj', 'gate_proj', 'k_proj'"):
        make_engine(model_dirs["qwen2"], lora=LoraConfig(rank=4, alpha=8.0, target_modules=("qkv_proj",)))
    engine = make_engine(
        model_dirs["qwen2"], lora=LoraConfig(rank=4, alpha=8.0, target_modules=("all-linear",))
    )
    buckets = engine.weight_buckets(version=1, lora="adapter")
    adapted = {name.split(".")[-3] for b in buckets for name, _ in b.tensors() if "lora_A" in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_a_value_model_trains_without_dropout_before_its_head(tmp_path):
    """Qwen2/Llama configs name neither ``classifier_dropout`` nor ``hidden_dropout``, so transformers' token
    classification head applied ``Dropout(0.1)``: a critic trained on noisy values (train-mode values differed
    from eval-mode ones, and from the Megatron head's). In train mode the values now equal eval mode's."""
    path = make_tiny_model_dir(tmp_path / "critic", arch="qwen2", model_type="value_model")
    config = json.loads((path / "config.json").read_text())
    for key in ("classifier_dropout", "hidden_dropout"):
        config.pop(key, None)
    (path / "config.json").write_text(json.dumps(config))
    engine = FSDPEngine(
        model_config=ModelConfig(path=str(path), model_type="value_model"),
        engine_config=FSDPEngineConfig(
            device=device_under_test(), micro_batch=MicroBatchConfig(micro_batch_size=2)
        ),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    batch = make_batch()
    with engine.eval_mode():
        evaluated = engine.infer_batch(batch).outputs["values"]
    with engine.train_mode():
        trained = engine.forward_backward_batch(batch, forward_only=True).outputs["values"]
    assert max_diff(trained, evaluated) == 0.0


def test_a_forward_only_pass_leaves_every_parameter_sharded(model_dirs):
    """FSDP2 reshards its root (embeddings, final norm, head; kept gathered for backward) only in backward: after
    an inference pass they stayed gathered (an inference-only engine held them for good) and ``parameters()``
    gave plain tensors, so a step after it clipped without their gradients and the next forward used the
    weights from before the step. Here: forward/backward, an inference pass, then the step, equal the same
    without the inference pass."""
    from torch.distributed.tensor import DTensor

    def step(with_inference: bool) -> tuple[float, dict]:
        engine = make_engine(model_dirs["qwen2"], optimizer=dataclasses.replace(OPTIMIZER, clip_grad=0.01))
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(make_batch(seed=1), token_mean_nll)
            if with_inference:
                engine.forward_backward_batch(make_batch(seed=2), forward_only=True)
                assert all(isinstance(p, DTensor) for p in engine.module.parameters())
            norm = engine.optimizer_step()
        return norm, exported_on_cpu(engine)

    (norm, weights), (expected_norm, expected) = step(True), step(False)
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())


def test_bad_configs_name_the_fix(model_dirs, tmp_path):
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size"):
        FSDPEngineConfig(ulysses_sequence_parallel_size=0)
    with pytest.raises(ConfigError, match="only one"):
        FSDPEngineConfig(cpu_offload_policy=True, param_offload=True)
    with pytest.raises(ConfigError, match="does not divide"):
        FSDPEngineConfig(ulysses_sequence_parallel_size=3).check_world(2)
    with pytest.raises(ConfigError, match="does not divide"):
        FSDPEngineConfig(ulysses_sequence_parallel_size=3).data_parallel_size(4)
    assert FSDPEngineConfig(ulysses_sequence_parallel_size=2, fsdp_size=2).data_parallel_size(4) == 2
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


def test_from_config_only_initialises_from_the_seed(model_dirs):
    model = ModelConfig(path=str(model_dirs["qwen2"]), from_config_only=True)
    engine = FSDPEngine(model_config=model, engine_config=FSDPEngineConfig(seed=7), optimizer_config=None)
    engine.initialize()
    torch.manual_seed(7)
    expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dirs["qwen2"])).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).state_dict()
    exported = dict(engine.export_weights())
    assert all(torch.equal(exported[name], expected[name]) for name in expected)
    assert not torch.equal(exported["lm_head.weight"], loaded["lm_head.weight"])


def test_bf16_compute_keeps_fp32_master_weights(model_dirs):
    engine = make_engine(model_dirs["qwen2"], param_dtype="bfloat16")
    batch = make_batch(seed=8)
    with engine.eval_mode():
        log_probs = engine.infer_batch(batch).outputs["log_probs"]
    diff = max_diff(log_probs, reference_log_probs(model_dirs["qwen2"], batch))
    assert 1e-5 < diff < 5e-2  # bf16 rounding is visible, but small
    with engine.train_mode():
        engine.train_batch(batch, token_mean_nll)
    assert {tensor.dtype for _, tensor in engine.export_weights()} == {torch.float32}


def dcp_keys(step_dir):
    return set(FileSystemReader(step_dir / "model").read_metadata().state_dict_metadata)


def test_checkpoint_keys_are_hf_and_peft_names_and_lora_resumes(model_dirs, tmp_path):
    plain = make_engine(model_dirs["qwen2"], optimizer=None)
    plain.save_checkpoint(tmp_path / "plain", global_step=0)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"])
    assert dcp_keys(tmp_path / "plain" / "global_step_0") == set(hf_model.state_dict())

    engine = make_engine(model_dirs["qwen2"], lora=LORA)
    with engine.train_mode():
        engine.train_batch(make_batch(seed=9), token_mean_nll)
    engine.save_checkpoint(tmp_path / "lora", global_step=1)
    peft_model = get_peft_model(
        hf_model,
        PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.target_modules)),
    )
    keys = dcp_keys(tmp_path / "lora" / "global_step_1")
    assert keys == set(peft_model.state_dict())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in keys
    resumed = make_engine(model_dirs["qwen2"], lora=LORA)
    resumed.load_checkpoint(tmp_path / "lora")
    resumed_weights = dict(resumed.export_weights())
    assert all(torch.equal(resumed_weights[name], tensor) for name, tensor in engine.export_weights())


def test_fp16_training_is_refused_and_fp16_inference_runs(model_dirs):
    """No loss scaling here: fp16 training is refused with the fix (bf16); fp16 forward passes stay allowed."""
    with pytest.raises(ConfigError, match=r"param_dtype='float16' cannot train.*param_dtype='bfloat16'"):
        make_engine(model_dirs["qwen2"], param_dtype="float16")
    engine = make_engine(model_dirs["qwen2"], param_dtype="float16", optimizer=None)
    batch = make_batch(seed=9)
    with engine.eval_mode():
        log_probs = engine.infer_batch(batch).outputs["log_probs"]
    diff = max_diff(log_probs, reference_log_probs(model_dirs["qwen2"], batch))
    assert 1e-6 < diff < 1e-3  # fp16 rounding is visible (measured 1.3e-4), but small


def test_steps_raise_no_view_output_warning(model_dirs):
    """The hidden-state head returns no view of the model's hidden states (regression: torch 2.15's FSDP2
    warned on every run's first step that a view output could drop its pre-backward hook)."""
    engine = make_engine(model_dirs["qwen2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with engine.train_mode():
            engine.train_batch(make_batch(), token_mean_nll)
        with engine.eval_mode():
            engine.infer_batch(make_batch())
    assert not [w for w in caught if "view tensor" in str(w.message)]


@pytest.mark.parametrize("defer", [False, True])
def test_gradients_stay_sharded_between_micro_batches_unless_deferred(model_dirs, defer):
    """Each micro-batch's backward reduce-scatters by default, so between micro-batches every parameter holds
    its sharded gradient; deferring the sync to the last micro-batch (the only behaviour before) keeps them
    unsharded inside FSDP instead, a full-size copy on every rank (28 GB for a 7B model in float32)."""
    engine = make_engine(model_dirs["qwen2"], defer_gradient_sync=defer)
    parameters = list(engine.module.parameters())
    with_grad: list[int] = []

    def counting_loss(outputs, micro_batch, context):
        with_grad.append(sum(p.grad is not None for p in parameters))
        return token_mean_nll(outputs, micro_batch, context)

    with engine.train_mode():
        engine.train_batch(make_batch(), counting_loss)
    assert with_grad[0] == 0 and len(with_grad) == 2  # two micro-batches of two sequences
    assert (with_grad[1] == len(parameters)) is not defer


def test_each_sequence_parallel_group_keeps_its_own_attention(monkeypatch) -> None:
    """The Ulysses attention read one process-global group, so a second engine in the process (a critic beside
    the actor) with another sequence-parallel size switched the first engine's attention to its group. Each
    registration now binds its group: the first name still splits over its own size (3), not the last (5)."""
    from drivetrain_engine_fsdp import ulysses
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setattr(ulysses.dist, "get_world_size", lambda group: group)  # a fake group is its size
    first, second = ulysses.register_ulysses_attention(3), ulysses.register_ulysses_attention(5)
    query = torch.zeros(1, 4, 2, 8)
    for name, size in ((first, 3), (second, 5)):
        with pytest.raises(ValueError, match=f"ulysses_sequence_parallel_size={size}"):
            ALL_ATTENTION_FUNCTIONS[name](torch.nn.Module(), query, query, query, None)
