"""A resumed pairwise run (``dpo``, ``rm``) must start from the model its first part started from.

The start is ``model.path`` as it is (``warm_start.sft_steps=0``) or the SFT warm start trained from it; the
run's checkpoints and DPO's reference log-probs were made from it. The run's ``config.yaml`` (written by the
new run, rewritten by a resume only once its checkpoint fits) records both fields.
"""

from __future__ import annotations

from pathlib import Path

from drivetrain_engine_core.errors import CheckpointError

from ..jobs.assets import same_model_path
from ..jobs.launch import CONFIG_FILE
from ..runtime.command_config import read_yaml


def check_resumed_start(run_dir: Path, model_path: str, sft_steps: int) -> None:
    """Refuse a resume of the run in ``run_dir`` from another start than the one its ``config.yaml`` records
    (another ``model.path``, or a warm start where it had none or the reverse); every rank, before anything
    loads or writes. A run folder without ``config.yaml`` records nothing to check.

    NOTE: without a warm start nothing else recorded the start: a ``drivetrain dpo --resume`` with another
    model of the same shape went on from the checkpoint with the reference log-probs of the new
    ``model.path``, one run of two models. Warm starts of other lengths are not refused: the finished warm
    start is reused whatever ``sft_steps`` says now.

    Raises:
        CheckpointError: the start differs; names the recorded and the asked start and the fix.
    """
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        return
    recorded = read_yaml(saved)
    run_model = recorded.get("model", {}).get("path")
    run_steps = recorded.get("warm_start", {}).get("sft_steps")
    if run_model is None or run_steps is None:
        return
    if same_model_path(run_model, model_path) and (run_steps == 0) == (sft_steps == 0):
        return
    raise CheckpointError(
        f"the run in {run_dir} started from {_start(run_model, run_steps)} ({saved}), this --resume from "
        f"{_start(model_path, sft_steps)}; its checkpoints (and a DPO run's reference) were made from the run's "
        f"start. Resume with model.path={run_model} warm_start.sft_steps={run_steps}, or start a new run "
        "without --resume."
    )


def _start(model_path: str, sft_steps: int) -> str:
    """A start in words: the model and whether an SFT warm start trained it first."""
    warm = f"after a warm start of {sft_steps} SFT steps" if sft_steps else "without a warm start"
    return f"model.path={model_path} {warm}"
