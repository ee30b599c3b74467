"""The pad token's embedding lookups train nothing, as in Hugging Face, while a tied output layer still trains
the pad token's row through its logit (regression: the row's whole gradient was zeroed, 2e-5 off in grad norm).

Single process, float32, one tied Qwen2 and one untied, each batch holding the pad token as an input and as a
label inside the loss mask; two steps against plain HF training.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, make_batch
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    reference_train_losses,
    token_mean_nll,
    train_history,
)
from drivetrain_engine_core.testing.device import device_under_test

# The GPU machine may lack megatron-core and mbridge: the lane skips these rather than failing them.
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = pytest.mark.slow

OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0)


def _batches(model_dir: Path) -> list:
    config = json.loads((model_dir / "config.json").read_text())
    pad, vocab = config["pad_token_id"], config["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = [torch.randint(1, vocab, (n,), generator=generator) for n in (7, 5, 9)]
        ids[0][2], ids[1][4], ids[2][6] = pad, pad, pad  # in prompts and responses: looked up and predicted
        masks = [torch.tensor([0.0] * 2 + [1.0] * (len(seq) - 2)) for seq in ids]
        batches.append(make_batch(ids, loss_mask=masks))
    return batches


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pad_token_trains_like_hugging_face(tmp_path, tied):
    from drivetrain_engine_megatron import MegatronEngine, MegatronEngineConfig

    model_dir = make_tiny_model_dir(tmp_path / "qwen2", arch="qwen2", tie_word_embeddings=tied)
    assert json.loads((model_dir / "config.json").read_text())["pad_token_id"] is not None
    engine = MegatronEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=MegatronEngineConfig(
            device=device_under_test(), micro_batch=MicroBatchConfig(micro_batch_size=3)
        ),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    batches = _batches(model_dir)
    history = train_history(engine, batches, token_mean_nll)
    reference = reference_train_losses(model_dir, batches, OPTIMIZER, token_mean_nll)
    # CUDA against the CPU reference rounds differently through AdamW (the conformance kit's 1e-5); the bug
    # moved the grad norm by 3%.
    rel = 1e-5 if device_under_test() == "cuda" else 1e-6
    for (loss, norm), (ref_loss, ref_norm) in zip(history, reference, strict=True):
        assert loss == pytest.approx(ref_loss, rel=rel)
        assert norm == pytest.approx(ref_norm, rel=2 * rel)
