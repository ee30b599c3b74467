"""An SFT warm start: ``drivetrain sft`` run once in ``<run>/warm_start``, the start of a DPO, RM or GRPO run.

A resumed run reuses the warm start its first part finished (its checkpoints, and a DPO reference, were made
from that ``final_model``); the warm start's ``summary.json``, written last, marks it finished. Any other run
replaces it: a new run in the folder (``--overwrite``) may have changed the model, data, seed or steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..jobs.final_model import FINAL_MODEL_DIR
from ..jobs.launch import SUMMARY_FILE
from .config import SFTConfig
from .trainer import SFTTrainer

WARM_START_DIR = "warm_start"


def run_warm_start(
    config: SFTConfig, output_dir: Path, *, reuse: bool, batch_size_setting: str
) -> tuple[str, dict[str, float]]:
    """Run the warm start into ``<output_dir>/warm_start`` (replacing an earlier one), or with ``reuse`` take
    the finished one there (its summary is written last). ``batch_size_setting`` names the calling command's
    field of the warm start's batch size, for errors (the SFT run's own ``trainer.batch_size`` is not the user's).

    Returns:
        Its final model and its last held-out evaluation (empty without held-out data).
    """
    target = output_dir / WARM_START_DIR
    summary = target / SUMMARY_FILE
    if reuse and summary.is_file():
        evaluations = json.loads(summary.read_text())["evaluations"]
    else:
        trainer = SFTTrainer(config, target, overwrite=True, batch_size_setting=batch_size_setting)
        evaluations = trainer.run().evaluations
    last = {k: v for k, v in evaluations[-1].items() if k != "step"} if evaluations else {}
    return str(target / FINAL_MODEL_DIR), last
