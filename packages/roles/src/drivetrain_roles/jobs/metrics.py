"""Where SFT metrics go: the console, the ``trainer.report_to`` trackers (``metrics.jsonl`` by default), a PNG.

Only the output rank writes. Trackers come from core (:mod:`drivetrain_roles.runtime.tracking`); on resume the
JSONL tracker drops records after the resumed step first, so the file and the curve describe one run.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from drivetrain_engine_core import distributed
from drivetrain_engine_core.outputs import ForwardBackwardOutput

from ..runtime.tracking import METRICS_FILE, RunInfo, open_trackers, read_records

logger = logging.getLogger(__name__)
CURVE_FILE = "loss_curve.png"


class MetricsWriter:
    """Writes metric records of the output rank to every tracker and keeps them for the loss curve.

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
    """Save the training loss per step, with held-out loss and accuracy points, as a PNG (matplotlib, Agg)."""
    return plot_curves(
        records,
        path,
        left=[("train/loss", "train loss", "-"), ("val/loss", "held-out loss", "o-")],
        left_label="loss (NLL per response token)",
        log_scale=True,
    )


def plot_curves(
    records: list[dict[str, Any]],
    path: Path,
    *,
    left: Sequence[tuple[str, str, str]],
    left_label: str,
    log_scale: bool = False,
) -> Path:
    """Save ``left`` series ``(metric, label, style)`` per step, and held-out accuracy on a right axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, left_axis = plt.subplots(figsize=(7, 4))
    for key, label, style in left:
        _plot_series(left_axis, records, key, label, style)
    left_axis.set_xlabel("step")
    left_axis.set_ylabel(left_label)
    if log_scale:
        left_axis.set_yscale("log")
    accuracy_axis = left_axis.twinx()
    _plot_series(accuracy_axis, records, "val/accuracy", "held-out accuracy", "s--", color="tab:green")
    accuracy_axis.set_ylabel("accuracy")
    accuracy_axis.set_ylim(0, 1)
    figure.legend(loc="upper center", ncol=3, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _plot_series(
    axis: Any, records: list[dict[str, Any]], key: str, label: str, style: str, **kwargs: Any
) -> None:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and math.isfinite(r[key])]
    if points:
        steps, values = zip(*points, strict=True)
        axis.plot(steps, values, style, label=label, **kwargs)
