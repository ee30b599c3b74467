"""Weights & Biases (needs the ``wandb`` package; project from ``WANDB_PROJECT``, default ``drivetrain``)."""

from __future__ import annotations

import os

from .base import RunInfo, Tracker


class WandbTracker(Tracker):
    """One W&B run per drivetrain run, named after the run directory, with the resolved config."""

    def __init__(self, run: RunInfo) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "drivetrain"),
            name=run.name,
            dir=str(run.run_dir),
            config=run.config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
