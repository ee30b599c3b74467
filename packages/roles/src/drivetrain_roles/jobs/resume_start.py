"""A resumed run must start from the model its first part started from (every job with a start model).

The start is ``model.path``, and for ``dpo``/``rm`` whether an SFT warm start trained it first
(``warm_start.sft_steps``; ``grpo``/``ppo`` warm-start exactly when ``model.path`` is the embedded model). The
run's checkpoints, DPO's reference log-probs, GRPO's and PPO's KL reference and PPO's critic start were made from
it. The run's ``config.yaml`` (written by the new run, rewritten by a resume only once its checkpoint fits)
records it, and for a Hub id the snapshot it resolved to (:mod:`.start_snapshot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import CheckpointError

from ..runtime.command_config import read_yaml
from .assets import is_hub_id, local_model_directory, same_model_path
from .launch import CONFIG_FILE
from .start_snapshot import START_SNAPSHOT_FILE, record_start_snapshot, started_snapshot

WarmStart = tuple[str, int]
"""A job's warm-start setting and its value, e.g. ``("warm_start.sft_steps", 2)``; 0 runs none."""


def check_or_record_start(
    run_dir: Path, model_path: str, *, resume: bool, warm_start: WarmStart | None = None
) -> None:
    """A resume: :func:`check_resumed_start`. A new run: record the Hub snapshot of a Hub id ``model.path``
    (:func:`.start_snapshot.record_start_snapshot`), which a resume is then checked against."""
    if resume:
        check_resumed_start(run_dir, model_path, warm_start)
    else:
        record_start_snapshot(run_dir, model_path)


def check_resumed_start(run_dir: Path, model_path: str, warm_start: WarmStart | None = None) -> None:
    """Refuse a resume of the run in ``run_dir`` from another start than the one its ``config.yaml`` records
    (another ``model.path``; with ``warm_start``, also a warm start where it had none or the reverse); every
    rank, before anything loads or writes. A run folder without ``config.yaml`` records nothing to check.

    NOTE: without a warm start nothing else recorded the start: a ``--resume`` with another model of the same
    shape went on from the checkpoint with the new ``model.path``'s reference (and PPO's critic start), one run
    of two models. Warm starts of other lengths are not refused: the finished warm start is reused whatever the
    setting says now.

    Args:
        run_dir: the run folder being resumed.
        model_path: the asked ``model.path``.
        warm_start: the job's warm-start setting and asked value; ``None`` where ``model.path`` alone decides.

    Raises:
        CheckpointError: the start differs; names the recorded and the asked start and the fix.
    """
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        return
    recorded = read_yaml(saved)
    run_model = recorded.get("model", {}).get("path")
    run_warm = None if warm_start is None else _recorded_warm_start(recorded, warm_start[0])
    if run_model is None or (warm_start is not None and run_warm is None):
        return
    # A run from a Hub id is its snapshot: the id may name a newer revision by now.
    snapshot = started_snapshot(run_dir)
    start = run_model if snapshot is None else snapshot
    fix = run_model if same_model_path(start, run_model) else snapshot
    started = (
        ""
        if snapshot is None
        else f", the Hugging Face snapshot {snapshot} ({run_dir / START_SNAPSHOT_FILE})"
    )
    if same_model_path(start, model_path) and _warms(run_warm) == _warms(warm_start):
        return
    now = local_model_directory(model_path) if is_hub_id(model_path) else None
    asked = "" if now is None or snapshot is None else f", now the snapshot {now} (a newer revision)"
    setting = "" if run_warm is None else f" {run_warm[0]}={run_warm[1]}"
    raise CheckpointError(
        f"the run in {run_dir} started from {_start(run_model, run_warm)} ({saved}){started}, this --resume "
        f"from {_start(model_path, warm_start)}{asked}; its checkpoints (and any reference) were made from the "
        f"run's start. Resume with model.path={fix}{setting}, or start a new run without --resume."
    )


def _recorded_warm_start(recorded: dict[str, Any], setting: str) -> WarmStart | None:
    """The warm-start setting's value in the run's config, ``None`` where it records none."""
    section, key = setting.split(".")
    steps = recorded.get(section, {}).get(key)
    return None if steps is None else (setting, steps)


def _warms(warm_start: WarmStart | None) -> bool:
    return warm_start is not None and warm_start[1] != 0


def _start(model_path: str, warm_start: WarmStart | None) -> str:
    """A start in words: the model and, where the job says, whether an SFT warm start trained it first."""
    if warm_start is None:
        return f"model.path={model_path}"
    warm = f"after a warm start of {warm_start[1]} SFT steps" if warm_start[1] else "without a warm start"
    return f"model.path={model_path} {warm}"
