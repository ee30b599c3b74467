"""Where SFT metrics go: the console, ``metrics.jsonl``, TensorBoard when installed, and a loss-curve PNG.

Only the output rank writes. ``metrics.jsonl`` holds one JSON object per record (``{"step": N, ...}``); on
resume, records after the resumed step are dropped first, so the file and the curve describe one run. A
non-finite value (the loss of a step whose update was skipped) is written as ``null``: ``NaN`` is not JSON.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss_curve.png"


class MetricsWriter:
    """Writes metric records of the output rank.

    Args:
        output_dir: the run directory.
        enabled: whether this rank writes (the output rank) or stays silent.
        resume_step: keep only records up to this step from an earlier, interrupted run (``None``: start a new
            file).
    """

    def __init__(self, output_dir: Path, *, enabled: bool, resume_step: int | None = None) -> None:
        self.enabled = enabled
        self.path = output_dir / METRICS_FILE
        self.records: list[dict[str, Any]] = []
        self._tensorboard = None
        if not enabled:
            return
        if resume_step is not None:
            self.records = [r for r in read_records(self.path) if r["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(json_safe(r), allow_nan=False) + "\n" for r in self.records))
        self._tensorboard = _open_tensorboard(output_dir / "tensorboard")

    def write(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at ``step`` (JSONL, TensorBoard)."""
        if not self.enabled:
            return
        record = {"step": step, **values}
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (dicts and lists followed)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (empty if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _open_tensorboard(directory: Path) -> Any:
    """A TensorBoard ``SummaryWriter`` when the ``tensorboard`` package is installed, else ``None``."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(directory))


def format_record(values: dict[str, float]) -> str:
    """One console line: ``name=value`` pairs with 4 significant digits."""
    return " ".join(f"{name}={value:.4g}" for name, value in values.items())


def plot_loss_curve(records: list[dict[str, Any]], path: Path) -> Path:
    """Save the training loss per step, with held-out loss and accuracy points, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, loss_axis = plt.subplots(figsize=(7, 4))
    _plot_series(loss_axis, records, "train/loss", "train loss", "-")
    _plot_series(loss_axis, records, "val/loss", "held-out loss", "o-")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss (NLL per response token)")
    loss_axis.set_yscale("log")
    accuracy_axis = loss_axis.twinx()
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
