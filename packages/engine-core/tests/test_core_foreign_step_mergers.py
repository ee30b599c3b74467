"""An engine reads another backend's step through the merger lookup it was built with, not a process-wide slot.

The engine factory hands each engine its plugin set's ``mergers.get``; an engine built without one refuses a
foreign step with the fix, instead of depending on whichever registry some earlier import happened to load.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from drivetrain_engine_core.backend import CheckpointError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.kit import HFTrainingState
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

VOCAB = 64


class ResumingEngine(TinyTorchEngine):
    """A second backend that resumes from other backends' steps (``hf_state_resume``) and records the state."""

    backend_name = "tiny-resume"
    capabilities = replace(TinyTorchEngine.capabilities, hf_state_resume=True)

    def _load_hf_state(self, state: HFTrainingState, *, load_optimizer: bool) -> None:
        self.calls.append(("load_hf_state", type(state.merger).__name__, str(load_optimizer)))
        self.hf_state = state


class RecordingMerger:
    """Stands for the tiny backend's merger: what a merger is built from."""

    def __init__(self, step_dir: Path, manifest: Any) -> None:
        self.step_dir, self.manifest = step_dir, manifest


def _engine(cls: type[TinyTorchEngine], **kwargs: Any) -> TinyTorchEngine:
    engine = cls(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(vocab_size=VOCAB),
        optimizer_config=OptimizerConfig(lr=0.1),
        **kwargs,
    )
    engine.initialize()
    return engine


def test_a_foreign_step_is_read_by_the_merger_the_engine_was_given(tmp_path: Path) -> None:
    step = _engine(TinyTorchEngine).save_checkpoint(tmp_path, global_step=3)
    asked: list[str] = []

    def mergers(backend: str) -> Any:
        asked.append(backend)
        return RecordingMerger

    engine = _engine(ResumingEngine, mergers=mergers)
    assert engine.load_checkpoint(tmp_path)["global_step"] == 3
    assert asked == ["tiny"]
    assert ("load_hf_state", "RecordingMerger", "True") in engine.calls
    assert engine.hf_state.step_dir == step and engine.hf_state.manifest.backend == "tiny"


def test_an_engine_built_without_mergers_refuses_a_foreign_step_with_the_fix(tmp_path: Path) -> None:
    _engine(TinyTorchEngine).save_checkpoint(tmp_path, global_step=3)
    engine = _engine(ResumingEngine)
    with pytest.raises(
        CheckpointError, match=r"written by the 'tiny' backend.*build it with .*create_engine"
    ):
        engine.load_checkpoint(tmp_path)
    assert not any(call[0] == "load_hf_state" for call in engine.calls)
