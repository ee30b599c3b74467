"""Weights & Biases (needs the ``wandb`` package; project from ``WANDB_PROJECT``, default ``drivetrain``)."""

from __future__ import annotations

import os
import uuid

from .base import RunInfo, Tracker, resumed_run_id, store_run_id


class WandbTracker(Tracker):
    """One W&B run per drivetrain run, named after the run directory, with the resolved config; a resumed run
    continues the same W&B run (its id is kept in the run directory), where it used to start a new one."""

    def __init__(self, run: RunInfo) -> None:
        import wandb

        run_id = resumed_run_id(run, "wandb") or uuid.uuid4().hex[:16]
        store_run_id(run, "wandb", run_id)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "drivetrain"),
            name=run.name,
            id=run_id,
            resume="allow",
            dir=str(run.run_dir),
            config=run.config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
