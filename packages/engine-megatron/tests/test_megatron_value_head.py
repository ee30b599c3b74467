"""A Megatron value model can start from a language model's checkpoint (a reward model, a critic), as with FSDP.

Regression: the checkpoint has no ``score`` head and the load failed ("Weights {'score.weight'} not found"),
so ``drivetrain rm engine.backend=megatron`` crashed. The head now starts as transformers starts a missing
``score`` (normal with the config's ``initializer_range`` from the engine seed, no bias when the config says
``token_classification_bias: false``); the trunk loads from the checkpoint. Reference: Hugging Face's value
model holding the language model's weights and that head, written out by the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, reference_values
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow

SEED = 3


def value_start(language_model: Path, target: Path) -> Path:
    """``language_model``'s files with a one-label, bias-free token-classification config (drivetrain rm's)."""
    shutil.copytree(language_model, target)
    config = json.loads((target / "config.json").read_text())
    config.update(num_labels=1, token_classification_bias=False, classifier_dropout=0.0)
    (target / "config.json").write_text(json.dumps(config))
    return target


def expected_head(config: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.empty(1, config["hidden_size"]).normal_(std=config["initializer_range"], generator=generator)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_value_model_starts_from_a_language_model_checkpoint(tmp_path, tied):
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    language_model = make_tiny_model_dir(tmp_path / "lm", arch="qwen2", tie_word_embeddings=tied)
    start = value_start(language_model, tmp_path / "start")
    config = json.loads((start / "config.json").read_text())
    reference_dir = value_start(start, tmp_path / "reference")
    weights = load_file(reference_dir / "model.safetensors")
    weights.pop("lm_head.weight", None)
    save_file({**weights, "score.weight": expected_head(config)}, reference_dir / "model.safetensors")

    engine = MegatronEngine(
        model_config=ModelConfig(path=str(start), model_type="value_model"),
        engine_config=MegatronEngineConfig(seed=SEED, micro_batch=MicroBatchConfig(micro_batch_size=2)),
    )
    engine.initialize()
    exported = dict(engine.export_weights())
    assert "score.bias" not in exported
    torch.testing.assert_close(exported["score.weight"], expected_head(config), atol=0, rtol=0)

    batch = random_batch(
        vocab_size=config["vocab_size"], prompt_lengths=[3, 5], response_lengths=[4, 2], seed=0
    )
    with engine.eval_mode():
        values = engine.infer_batch(batch).outputs["values"].values()
    torch.testing.assert_close(values, reference_values(reference_dir, batch).values(), atol=1e-5, rtol=1e-5)


def test_a_reward_model_saved_without_a_score_bias_starts_its_bias_at_zero(tmp_path):
    """A ``*ForSequenceClassification`` reward model has ``score.weight`` and no bias, while its config need not
    say ``token_classification_bias: false``: every head parameter was read once ``score.weight`` existed, and
    the load failed ("Weights {'score.bias'} not found"). The missing bias starts at zero, as transformers
    starts it; the weight loads."""
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    start = value_start(make_tiny_model_dir(tmp_path / "lm", arch="qwen2"), tmp_path / "rm")
    config = json.loads((start / "config.json").read_text())
    config.pop("token_classification_bias")
    (start / "config.json").write_text(json.dumps(config))
    weights = load_file(start / "model.safetensors")
    weights.pop("lm_head.weight", None)
    score = torch.randn(1, config["hidden_size"], generator=torch.Generator().manual_seed(5)) * 0.1
    save_file({**weights, "score.weight": score}, start / "model.safetensors")

    engine = MegatronEngine(
        model_config=ModelConfig(path=str(start), model_type="value_model"),
        engine_config=MegatronEngineConfig(seed=SEED, micro_batch=MicroBatchConfig(micro_batch_size=2)),
    )
    engine.initialize()
    exported = dict(engine.export_weights())
    torch.testing.assert_close(exported["score.weight"], score, atol=0, rtol=0)
    assert torch.equal(exported["score.bias"], torch.zeros(1))
    batch = random_batch(
        vocab_size=config["vocab_size"], prompt_lengths=[3, 5], response_lengths=[4, 2], seed=0
    )
    with engine.eval_mode():
        values = engine.infer_batch(batch).outputs["values"].values()
    torch.testing.assert_close(values, reference_values(start, batch).values(), atol=1e-5, rtol=1e-5)


TOKENS, HIDDEN = 6, 5


def _sequence_parallel_value_head(rank: int, world_size: int) -> dict:
    """This rank's half of the tokens through a value head that gathers them over the (2-rank) group."""
    import torch.distributed as dist
    from drivetrain_engine_megatron.cpu_compat import apply_cpu_compat
    from drivetrain_engine_megatron.value_head import ValueHead

    apply_cpu_compat()  # megatron's sequence gather allocates on torch.cuda.current_device()
    hidden, weight, bias, loss_weights = _value_head_inputs()
    head = ValueHead(HIDDEN, torch.float32, bias=True, sequence_parallel_group=dist.group.WORLD)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    half = TOKENS // world_size
    local = hidden[rank * half : (rank + 1) * half].clone().requires_grad_()
    values, _ = head(local)
    grad_local, grad_weight = torch.autograd.grad(
        (values[:, 0, 0] * loss_weights).sum(), (local, head.weight)
    )
    return {"values": values.detach(), "grad_local": grad_local, "grad_weight": grad_weight}


def _value_head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, 1, HIDDEN, generator=generator)
    weight, bias = torch.randn(1, HIDDEN, generator=generator), torch.randn(1, generator=generator)
    return hidden, weight, bias, torch.linspace(-1.0, 2.0, TOKENS)


def test_value_head_under_sequence_parallelism_scores_the_whole_row_once():
    """Under sequence parallelism each TP rank holds a slice of the tokens. The head gathers them, so every
    rank scores the whole row, and each rank's gradient is its slice of the single-process gradient: the
    backward splits, where a reduce-scatter would count the replicated loss once per rank. Before, the head
    scored only the rank's slice. Reference: the same linear on the whole row in one process."""
    from drivetrain_engine_core.testing.launcher import run_distributed

    hidden, weight, bias, loss_weights = _value_head_inputs()
    full = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    values = full @ weight.T + bias
    grad_full, grad_weight = torch.autograd.grad((values[:, 0, 0] * loss_weights).sum(), (full, weight))

    ranks = run_distributed(_sequence_parallel_value_head, world_size=2)

    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["values"], values.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(got["grad_local"], grad_full[rank * 3 : (rank + 1) * 3], atol=1e-6, rtol=0)
        torch.testing.assert_close(got["grad_weight"], grad_weight, atol=1e-6, rtol=0)
