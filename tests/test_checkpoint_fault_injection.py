"""Fault injection: a training process killed (``os._exit``, no cleanup) at each named point of a checkpoint
save leaves a root whose resolved step is the last complete one, and that step loads with the exact weights it
was saved with. Each case is a real subprocess killed at a point named in ``checkpoint.points``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core._checkpoint import PUBLISH_POINTS
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import resolve_step_dir
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

pytestmark = pytest.mark.slow

KILLED = 9

CHILD = """
import os, sys
from pathlib import Path
import torch
from drivetrain_engine_core._checkpoint import set_fault_hook
from drivetrain_engine_core._config import CheckpointConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.testing import random_batch, token_mean_nll
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

root, point, last_save = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
engine = TinyTorchEngine(
    model_config=ModelConfig(path="tiny-model"),
    engine_config=TinyEngineConfig(vocab_size=16, hidden_size=4),
    optimizer_config=OptimizerConfig(lr=0.1),
    checkpoint_config=CheckpointConfig(max_ckpt_to_keep=1),
)
engine.initialize()
for save, step in enumerate((1, 2, last_save)):
    with engine.train_mode():
        engine.train_batch(random_batch(vocab_size=16, prompt_lengths=[2], response_lengths=[3], seed=save),
                           token_mean_nll)
    torch.save(dict(engine.export_weights()), root.parent / f"weights_save{save}.pt")
    if save == 2:
        set_fault_hook(lambda reached: os._exit(KILLED) if reached == point else None)
    engine.save_checkpoint(root, step)
os._exit(0)
""".replace("KILLED", str(KILLED))

# (point, step of the last save, which save's weights must resolve): a new step 3, or step 2 saved again.
CASES = [
    ("files_synced", 3, 1),
    ("manifest_written", 3, 1),
    ("step_renamed", 3, 1),  # step 3 is in place, `latest` still names the complete step 2
    ("latest_replaced", 3, 2),
    ("step_invalidated", 3, 2),  # pruning step 2 was interrupted
    ("old_step_aside", 2, 1),  # re-save of step 2: only the aside copy of the first save is complete
    ("latest_replaced", 2, 2),  # re-save: new copy published, aside copy not yet deleted
]


def test_cases_cover_every_point():
    assert {point for point, _, _ in CASES} == set(PUBLISH_POINTS)


@pytest.mark.parametrize(("point", "last_save", "expected_save"), CASES)
def test_kill_during_save_resumes_the_last_complete_step(tmp_path: Path, point, last_save, expected_save):
    root = tmp_path / "checkpoints"
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(root), point, str(last_save)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == KILLED, f"never reached {point!r}:\n{child.stdout}\n{child.stderr}"
    expected_step = {0: 1, 1: 2, 2: last_save}[expected_save]
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(vocab_size=16, hidden_size=4),
        optimizer_config=OptimizerConfig(lr=0.1),
    )
    engine.initialize()
    assert resolve_step_dir(root).name.endswith(f"global_step_{expected_step}")
    assert engine.load_checkpoint(root)["global_step"] == expected_step
    expected = torch.load(tmp_path / f"weights_save{expected_save}.pt", weights_only=True)
    loaded = dict(engine.export_weights())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
