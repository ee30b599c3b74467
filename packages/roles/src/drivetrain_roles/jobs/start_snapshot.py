"""The Hugging Face snapshot a run started from, where its ``model.path`` is a Hub repository id.

A Hub id names whatever revision the cache's ``main`` points at, and every command fetches before it runs, so a
``--resume`` days later could load a newer revision than the one the run's checkpoints (and GRPO's, PPO's and
DPO's reference) were made from. A new run whose ``model.path`` is a Hub id records the snapshot directory it
resolved to in ``<run>/start_snapshot.json``; the resume check (:mod:`.resume_start`) compares against it.
"""

from __future__ import annotations

import json
from pathlib import Path

from drivetrain_engine_core.job import write_durably
from drivetrain_engine_core.kit import distributed

from .assets import is_hub_id, local_model_directory

START_SNAPSHOT_FILE = "start_snapshot.json"


def record_start_snapshot(run_dir: Path, model_path: str) -> None:
    """For a new run from a Hub id, write the snapshot directory it resolved to (rank 0); nothing otherwise,
    and a record of an earlier run in the folder goes."""
    if distributed.rank() != 0:
        return
    record = run_dir / START_SNAPSHOT_FILE
    record.unlink(missing_ok=True)
    snapshot = local_model_directory(model_path) if is_hub_id(model_path) else None
    if snapshot is not None:
        write_durably(record, json.dumps({"model.path": model_path, "snapshot": snapshot}) + "\n")


def started_snapshot(run_dir: Path) -> str | None:
    """The snapshot directory the run in ``run_dir`` started from, or None where it did not start from a Hub id."""
    record = run_dir / START_SNAPSHOT_FILE
    return json.loads(record.read_text())["snapshot"] if record.is_file() else None
