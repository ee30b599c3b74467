"""``compile_layers``: per-decoder-layer ``torch.compile`` agrees with eager; refused where it cannot run.

NOTE: the agreement test needs a GPU: the first inductor compilation of even the tiny model's layer took 93 s
of a shared 2-core CPU here, over the budget of a CPU test, so it runs in the GPU lane.
"""

from __future__ import annotations

import pytest
from drivetrain_engine_core.config import ConfigError, MicroBatchConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch
from drivetrain_engine_core.testing.device import requires_cuda
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_fsdp.config import FSDPEngineConfig
from drivetrain_engine_fsdp.engine import FSDPEngine


def test_refused_on_cpu_without_a_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ConfigError, match="compile_layers=True on device 'cpu' needs a C\\+\\+ compiler"):
        FSDPEngineConfig(device="cpu", compile_layers=True)


def train_two_steps(model_dir, compile_layers):
    engine = FSDPEngine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=FSDPEngineConfig(
            device="cuda", micro_batch=MicroBatchConfig(micro_batch_size=2), compile_layers=compile_layers
        ),
        optimizer_config=OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0),
    )
    engine.initialize()
    figures = []
    with engine.train_mode():
        for seed in (1, 2):
            batch = random_batch(vocab_size=64, prompt_lengths=[3, 5], response_lengths=[4, 6], seed=seed)
            output = engine.train_batch(batch, token_mean_nll)
            figures += [output.loss, output.metrics["grad_norm"]]
    return figures


@requires_cuda
def test_compiled_layers_agree_with_eager(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "qwen2", arch="qwen2")
    eager, compiled = train_two_steps(model_dir, False), train_two_steps(model_dir, True)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
