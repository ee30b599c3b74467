"""Where a job's metrics go: the console and the ``trainer.report_to`` trackers (``metrics.jsonl`` by default).

Only the output rank writes. Trackers come from core (:mod:`drivetrain_roles.runtime.tracking`); on resume the
JSONL tracker drops records after the resumed step first, so the file and the curve describe one run.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from drivetrain_engine_core.job import ForwardBackwardOutput
from drivetrain_engine_core.kit import distributed

from ..runtime.tracking import METRICS_FILE, RunInfo, open_trackers, read_records
from .curves import CURVE_FILE as CURVE_FILE  # its home before 0.4.1 (curves.py)
from .curves import LOSS_CURVES, Curves, Panel, Series

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Writes metric records of the output rank to every tracker and keeps them for the curve (:mod:`.curves`).

    Args:
        output_dir: the run directory.
        enabled: whether this rank writes (the output rank) or stays silent.
        report_to: tracker names (``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``).
        config: the resolved config as plain values (trackers log it as the run's parameters).
        resume_step: keep only records up to this step from an earlier, interrupted run (``None``: a new run).
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        report_to: Sequence[str] = ("jsonl",),
        config: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        self._trackers = []
        if not enabled:
            return
        if resume_step is not None and "jsonl" in report_to:
            # NOTE: without the jsonl tracker the file is not this run's (a stale one from an earlier run in the
            # folder fed its evaluations into summary.json and the loss curve).
            self.records = [r for r in read_records(output_dir / METRICS_FILE) if r["step"] <= resume_step]
        run = RunInfo(run_dir=output_dir, name=output_dir.name, config=config or {}, resume_step=resume_step)
        self._trackers = open_trackers(report_to, run)

    def write(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at ``step`` in every tracker."""
        if not self.enabled:
            return
        self.records.append({"step": step, **values})
        for tracker in self._trackers:
            tracker.log(step, values)

    def earlier_evaluations(self) -> list[dict[str, float]]:
        """The held-out evaluations a resumed run made up to its resumed step, as the output rank read them
        from ``metrics.jsonl``; the same list on every rank (a collective: every rank calls it). Empty for a
        new run, or when ``jsonl`` is not among the trackers."""
        kept = [r for r in self.records if len(r) > 1 and all(k == "step" or k.startswith("val/") for k in r)]
        return cast(list[dict[str, float]], distributed.broadcast_object(kept))

    def sync(self) -> None:
        """Make every tracker's records so far durable (before a checkpoint is saved)."""
        for tracker in self._trackers:
            tracker.sync()

    def close(self) -> None:
        """Close every tracker, each even when another fails; the first failure is raised after all are closed.

        NOTE: called in a ``finally``: a tracker failing to close (a service gone) hid the run's own error and
        left the trackers after it open.
        """
        failures = []
        for tracker in self._trackers:
            try:
                tracker.close()
            except Exception as e:  # every tracker still gets closed
                logger.warning(
                    "closing the %s tracker failed: %s: %s", type(tracker).__name__, type(e).__name__, e
                )
                failures.append(e)
        if failures and sys.exc_info()[1] is None:
            raise failures[0]


def step_record(output: ForwardBackwardOutput) -> dict[str, float]:
    """What ``sft``, ``dpo`` and ``rm`` record of one ``train_batch``: ``train/loss``, ``train/grad_norm``,
    ``train/lr`` and the engine's ``perf/*`` metrics (step time, global tokens, tokens/s, TFLOP/s per device,
    MFU with a known peak, peak device memory; docs/architecture.md §7.10)."""
    metrics = output.metrics
    speed = {name: value for name, value in metrics.items() if name.startswith("perf/")}
    return {
        "train/loss": float(output.loss),  # type: ignore[arg-type]
        "train/grad_norm": float(metrics["grad_norm"]),  # type: ignore[arg-type]
        "train/lr": float(metrics["lr"]),  # type: ignore[arg-type]
        **{name: float(value) for name, value in speed.items()},  # type: ignore[arg-type]
    }


def speed_postfix(values: dict[str, float]) -> dict[str, str]:
    """The progress bar's loss and speed: s/step, tokens/s, TFLOP/s per device and MFU (``n/a``: no peak)."""
    mfu = values.get("perf/mfu")
    return {
        "loss": f"{values['train/loss']:.4f}",
        "s_step": f"{values['perf/step_time_s']:.3f}",
        "tok_s": f"{values['perf/tokens_per_s']:.0f}",
        "tflops": f"{values.get('perf/tflops_per_device', float('nan')):.3g}",
        "mfu": "n/a" if mfu is None else f"{mfu:.1%}",
    }


def format_record(values: dict[str, float]) -> str:
    """One console line: ``name=value`` pairs with 4 significant digits."""
    return " ".join(f"{name}={value:.4g}" for name, value in values.items())


def plot_loss_curve(records: list[dict[str, Any]], path: Path) -> Path:
    """Deprecated (removed in 0.5.0): ``LOSS_CURVES.plot(records, path)`` (:mod:`.curves`)."""
    _deprecated("plot_loss_curve", "drivetrain_roles.jobs.curves.LOSS_CURVES.plot(records, path)")
    return LOSS_CURVES.plot(records, path)


def plot_curves(
    records: list[dict[str, Any]],
    path: Path,
    *,
    left: Sequence[tuple[str, str, str]],
    left_label: str,
    log_scale: bool = False,
) -> Path:
    """Deprecated (removed in 0.5.0): declare a :class:`~.curves.Curves` and call its ``plot``."""
    _deprecated("plot_curves", "a drivetrain_roles.jobs.curves.Curves declaration's plot(records, path)")
    series = tuple(Series(key=key, label=label, style=style) for key, label, style in left)
    accuracy = (Series(key="val/accuracy", label="held-out accuracy", style="s--"),)
    panels = (Panel(title=left_label, series=series, log_scale=log_scale),)
    return Curves((*panels, Panel(title="accuracy", series=accuracy, fraction=True))).plot(records, path)


def _deprecated(name: str, replacement: str) -> None:
    warnings.warn(
        f"drivetrain_roles.jobs.metrics.{name} is deprecated and will be removed in drivetrain-roles 0.5.0; "
        f"use {replacement}.",
        DeprecationWarning,
        stacklevel=3,
    )
