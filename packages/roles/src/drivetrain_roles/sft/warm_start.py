"""An SFT warm start: ``drivetrain sft`` run once in ``<run>/warm_start``, the start of a DPO, RM or GRPO run.

A resumed run reuses the warm start its first part finished (its checkpoints, and a DPO reference, were made
from that ``final_model``); the warm start's ``summary.json``, written last, marks it finished. Any other run
replaces it: a new run in the folder (``--overwrite``) may have changed the model, data, seed or steps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from drivetrain_engine_core.backend import CheckpointError

from ..jobs.assets import same_model_path
from ..jobs.final_model import FINAL_MODEL_DIR
from ..jobs.launch import SUMMARY_FILE
from .config import SFTConfig
from .trainer import SFTTrainer

WARM_START_DIR = "warm_start"


def run_warm_start(
    config: SFTConfig,
    output_dir: Path,
    *,
    reuse: bool,
    batch_size_setting: str,
    write_data: Callable[[], None] | None = None,
) -> tuple[str, dict[str, float]]:
    """Run the warm start into ``<output_dir>/warm_start`` (replacing an earlier one), or with ``reuse`` take
    the finished one there (its summary is written last). ``batch_size_setting`` names the calling command's
    field of the warm start's batch size, for errors (the SFT run's own ``trainer.batch_size`` is not the user's).
    ``write_data`` writes the files the SFT run reads (collective), only when it runs: a resumed run writes
    nothing here, so a resume refused later leaves the run folder as it was.

    Returns:
        Its final model and its last held-out evaluation (empty without held-out data).

    Raises:
        CheckpointError: ``reuse`` of a warm start trained from another ``model.path``.
    """
    target = output_dir / WARM_START_DIR
    summary = target / SUMMARY_FILE
    if reuse and summary.is_file():
        finished = json.loads(summary.read_text())
        _check_same_model(finished["config"]["model"]["path"], config.model.path, target)
        evaluations = finished["evaluations"]
    else:
        if write_data is not None:
            write_data()
        # A warm start is never resumed (a resumed run reuses only a finished one): Ctrl-C stops it at once.
        trainer = SFTTrainer(
            config, target, overwrite=True, batch_size_setting=batch_size_setting, ctrl_c_saves=False
        )
        evaluations = trainer.run().evaluations
    last = {k: v for k, v in evaluations[-1].items() if k != "step"} if evaluations else {}
    return str(target / FINAL_MODEL_DIR), last


def _check_same_model(trained: str, asked: str, target: Path) -> None:
    """Refuse to reuse the warm start in ``target``, trained from ``trained``, for a run of ``asked``.

    NOTE: a resumed run reuses the warm start whatever ``model.path`` says, so a ``--resume`` with another model
    went on training the run's model (and wrote into its folder) as if it were the one asked for.
    """
    if not same_model_path(trained, asked):
        raise CheckpointError(
            f"the warm start in {target} was trained from model.path={trained}, this --resume has model.path="
            f"{asked}, and the run's checkpoints were trained from it. Resume with model.path={trained}, or start "
            "a new run without --resume."
        )
