"""mbridge state per bridge: a tied model built first leaves the next model of the same family untouched."""

from __future__ import annotations

import json

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, reference_log_probs

pytestmark = pytest.mark.slow


def _log_probs(model_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's and the float32 Hugging Face reference's log-probs of one batch."""
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    engine = MegatronEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=MegatronEngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=2)),
        optimizer_config=None,
    )
    engine.initialize()
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batch = random_batch(vocab_size=vocab_size, prompt_lengths=[3, 5], response_lengths=[4, 2], seed=0)
    with engine.eval_mode():
        log_probs = engine.infer_batch(batch).outputs["log_probs"].values()
    return log_probs, reference_log_probs(model_dir, batch).values()


def test_tied_then_untied_model_in_one_process(tmp_path):
    """Qwen2Bridge maps a tied model's output layer to the embedding by editing a class-level dict; the
    untied Qwen2 built next must still load its own ``lm_head`` (and the class dict stays as shipped)."""
    from mbridge.models.qwen2 import Qwen2Bridge

    tied = make_tiny_model_dir(tmp_path / "tied", arch="qwen2", seed=1, tie_word_embeddings=True)
    untied = make_tiny_model_dir(tmp_path / "untied", arch="qwen2", seed=2)
    for model_dir in (tied, untied):
        log_probs, expected = _log_probs(model_dir)
        torch.testing.assert_close(
            log_probs, expected, atol=1e-5, rtol=0, msg=lambda m, d=model_dir: f"{d}: {m}"
        )
    assert Qwen2Bridge._DIRECT_MAPPING["output_layer.weight"] == "lm_head.weight"


def test_sliding_window_models_are_refused(tmp_path):
    """mbridge maps no sliding window onto GPTModel: such a model would silently attend to every token."""
    from drivetrain_engine_core.backend import ConfigError

    model_dir = make_tiny_model_dir(
        tmp_path / "windowed", arch="qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=0
    )
    with pytest.raises(ConfigError, match=r"sliding window \(sliding_window=3\).*use the fsdp backend"):
        _log_probs(model_dir)


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "dividing"), [(4, 2, 4, "[1, 2]"), (6, 3, 2, "[1, 3]")])
def test_a_tensor_parallel_size_that_splits_a_head_is_refused_naming_the_option(
    heads, kv_heads, tp, dividing
):
    """Megatron gives each tensor rank whole query and key/value heads; the sizes that do are named."""
    from drivetrain_engine_core.backend import ConfigError
    from drivetrain_engine_megatron.bridge import refuse_heads_not_split
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads)
    with pytest.raises(ConfigError) as refused:
        refuse_heads_not_split(config, tp)
    message = str(refused.value)
    assert f"engine.tensor_model_parallel_size={tp}" in message
    assert f"{heads} query heads and {kv_heads} key/value heads" in message
    assert message.endswith(f"divides both: {dividing}.")
    refuse_heads_not_split(config, 1)
    refuse_heads_not_split(Qwen2Config(hidden_size=48, num_attention_heads=4, num_key_value_heads=2), 2)
