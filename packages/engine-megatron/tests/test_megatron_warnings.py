"""A Megatron engine's build and training steps print none of the warnings megatron triggers by itself.

Each one appeared once per engine and rank in every run's output: megatron-core's "full scope is deprecated"
for its own ``cuda_graph_scope`` default (the bridge built the config with megatron's defaults first), and
torch's non-leaf ``.grad`` warning from the float32 distributed optimizer's ``zero_grad``.
"""

from __future__ import annotations

import json
import warnings

import pytest
from drivetrain_engine_core.config import MicroBatchConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_train_losses,
    token_mean_nll,
    train_history,
)

pytestmark = pytest.mark.slow

OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0)
MEGATRON_TRIGGERED = ("full scope is deprecated", "The .grad attribute of a Tensor that is not a leaf")


def test_build_and_train_without_megatron_triggered_warnings(tmp_path):
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    model_dir = make_tiny_model_dir(tmp_path / "model", arch="qwen2", seed=1)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    batches = [
        random_batch(vocab_size=vocab_size, prompt_lengths=[3, 5], response_lengths=[4, 2], seed=seed)
        for seed in range(2)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MegatronEngine(
            model_config=ModelConfig(path=str(model_dir)),
            engine_config=MegatronEngineConfig(
                use_distributed_optimizer=True, micro_batch=MicroBatchConfig(micro_batch_size=2)
            ),
            optimizer_config=OPTIMIZER,
        )
        engine.initialize()
        history = train_history(engine, batches, token_mean_nll)
    printed = [str(w.message) for w in caught if str(w.message).startswith(MEGATRON_TRIGGERED)]
    assert printed == []
    # Silencing changed nothing: the steps still equal plain float32 Hugging Face training.
    reference = reference_train_losses(model_dir, batches, OPTIMIZER, token_mean_nll)
    for (loss, norm), (ref_loss, ref_norm) in zip(history, reference, strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-4)
