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
from drivetrain_engine_core.config import MicroBatchConfig, ModelConfig
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
