"""Weights & Biases (needs the ``wandb`` package; project from ``WANDB_PROJECT``, default ``drivetrain``)."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from .base import RunInfo, Tracker, resumed_run_id, store_run_id

logger = logging.getLogger(__name__)


class WandbTracker(Tracker):
    """One W&B run per drivetrain run, named after the run directory, with the resolved config.

    A resumed run continues the same W&B run (its id is kept in the run directory), where it used to start a
    new one. W&B refuses steps below the last it holds, so the steps between the checkpoint and a crash keep
    the crashed run's values there (``metrics.jsonl`` has the resumed run's). A stored id W&B no longer
    accepts (a deleted run, another project) starts a new run, with a warning.
    """

    def __init__(self, run: RunInfo) -> None:
        import wandb

        resumed = resumed_run_id(run, "wandb")
        try:
            self._run = self._start(wandb, run, resumed or uuid.uuid4().hex[:16])
        except Exception as e:
            if resumed is None:
                raise
            logger.warning("W&B did not resume run %s (%s); starting a new W&B run.", resumed, e)
            self._run = self._start(wandb, run, uuid.uuid4().hex[:16])

    @staticmethod
    def _start(wandb: Any, run: RunInfo, run_id: str) -> Any:
        store_run_id(run, "wandb", run_id)
        return wandb.init(
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
