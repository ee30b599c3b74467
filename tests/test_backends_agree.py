"""Cross-backend agreement: Megatron and FSDP engines, built through the plugin factory by name, give the
same losses and grad norms on the same batches (single process)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, create_engine, engine_config_from_dict
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, token_mean_nll, train_history

pytestmark = pytest.mark.slow
pytest.importorskip("drivetrain_engine_fsdp")

OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01)


def _history(backend: str, path: str, batches: list) -> list[tuple[float, float]]:
    engine = create_engine(
        model_config=ModelConfig(path=path),
        engine_config=engine_config_from_dict(
            {"backend": backend, "micro_batch": MicroBatchConfig(micro_batch_size=2)}
        ),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    return train_history(engine, batches, token_mean_nll)


def test_megatron_matches_fsdp_engine(tmp_path):
    path = str(make_tiny_model_dir(tmp_path / "model", arch="qwen2"))
    batches = [
        random_batch(vocab_size=100, prompt_lengths=[2, 4, 3], response_lengths=[5, 3, 4], seed=seed)
        for seed in range(3)
    ]
    megatron, fsdp = _history("megatron", path, batches), _history("fsdp", path, batches)
    for (loss, norm), (fsdp_loss, fsdp_norm) in zip(megatron, fsdp, strict=True):
        assert loss == pytest.approx(fsdp_loss, rel=1e-5)
        assert norm == pytest.approx(fsdp_norm, rel=1e-5)
