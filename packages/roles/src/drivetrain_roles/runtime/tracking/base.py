"""The interface every metrics tracker implements (JSONL, TensorBoard, Weights & Biases, MLflow)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(kw_only=True, frozen=True)
class RunInfo:
    """What a tracker is told about the run when it opens.

    Attributes:
        run_dir: the run directory (trackers that write files write under it).
        name: the run's name (its directory name).
        config: the resolved config as plain values (logged as the run's parameters).
        resume_step: the step a resumed run continues from; ``None`` for a new run.
    """

    run_dir: Path
    name: str
    config: dict[str, Any]
    resume_step: int | None = None


def resumed_run_id(run: RunInfo, service: str) -> str | None:
    """The id of the ``service`` run (W&B, MLflow) a resumed drivetrain run continues, as
    :func:`store_run_id` kept it in the run directory; ``None`` for a new run."""
    path = run.run_dir / f".{service}_run_id"
    return path.read_text().strip() if run.resume_step is not None and path.is_file() else None


def store_run_id(run: RunInfo, service: str, run_id: str) -> None:
    """Keep the id of this run's ``service`` run in the run directory, for a resume."""
    (run.run_dir / f".{service}_run_id").write_text(run_id)


class Tracker(ABC):
    """Receives the metric records of the output rank."""

    @abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` (metric name -> number) at ``step``."""

    def sync(self) -> None:  # noqa: B027 - services keep what they received themselves
        """Make what was logged so far durable on local storage; called before a checkpoint is saved, so a
        checkpoint that survives a power loss is not missing metric lines of steps before it."""

    def close(self) -> None:  # noqa: B027 - most trackers have nothing to release
        """Flush and release what the tracker holds."""
