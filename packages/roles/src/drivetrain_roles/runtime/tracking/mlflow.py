"""MLflow (needs the ``mlflow`` package; tracking URI and experiment from MLflow's own environment variables)."""

from __future__ import annotations

import logging
from typing import Any

from .base import RunInfo, Tracker, resumed_run_id, store_run_id

logger = logging.getLogger(__name__)


class MlflowTracker(Tracker):
    """One MLflow run per drivetrain run, named after the run directory, the config flattened into params.

    A resumed run continues the same MLflow run (its id is kept in the run directory; params are logged once,
    MLflow refuses to change them); the steps between the checkpoint and a crash then hold a second value
    each. A stored id MLflow no longer knows starts a new run, with a warning.
    """

    def __init__(self, run: RunInfo) -> None:
        import mlflow

        self._mlflow = mlflow
        run_id = resumed_run_id(run, "mlflow")
        if run_id is not None:
            try:
                mlflow.start_run(run_id=run_id)
                return
            except Exception as e:
                logger.warning("MLflow did not resume run %s (%s); starting a new MLflow run.", run_id, e)
        store_run_id(run, "mlflow", mlflow.start_run(run_name=run.name).info.run_id)
        mlflow.log_params(_flatten(run.config))

    def log(self, step: int, values: dict[str, float]) -> None:
        self._mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
