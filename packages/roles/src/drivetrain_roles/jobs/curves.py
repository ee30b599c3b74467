"""A job's curve: the panels its command declares, drawn from its metric records as one PNG (matplotlib, Agg).

Each command says what it plots in one declaration (:class:`Curves`, a job's ``curves``): panels of series,
each series a metric of ``metrics.jsonl`` with the label it is shown under. Labels may name fields the job
fills from its config (``"DPO loss ({loss_type})"``). A panel without a single finite point is left out (a
run without held-out data, a KL term that is off). The PNG's text chunk ``drivetrain:series`` lists what was
drawn (panel, metric, label, point count, last value), so a reader (a test, a dashboard) need not read pixels.

NOTE: each panel's legend sits to the right of its axes, in a layout that makes room for it: a legend inside
the axes covered the curves it named, and one laid over the figure's top covered the frame.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CURVE_FILE = "loss_curve.png"
"""The curve's file name in the run folder, unless a job names another."""

SERIES_KEY = "drivetrain:series"
"""The PNG text chunk that lists the drawn series as JSON."""


@dataclass(kw_only=True, frozen=True)
class Series:
    """One metric drawn as a line.

    Attributes:
        key: the metric's name in the records (``val/loss``).
        label: its legend entry; ``{field}`` names a field the job fills (:meth:`TrainingJob._curve_fields`).
        style: matplotlib's format string (``-`` a line, ``o-`` a line with markers).
    """

    key: str
    label: str
    style: str = "-"


@dataclass(kw_only=True, frozen=True)
class Panel:
    """One axes of the curve.

    Attributes:
        title: the panel's title: what the series measure, naming the loss or metric exactly.
        series: what the panel draws.
        log_scale: a logarithmic y axis (losses that fall by orders of magnitude).
        fraction: the y axis spans 0 to 1 (accuracies).
    """

    title: str
    series: tuple[Series, ...]
    log_scale: bool = False
    fraction: bool = False


@dataclass(frozen=True)
class Curves:
    """What a command plots: its panels, top to bottom, over the step."""

    panels: tuple[Panel, ...]

    def with_panels(self, *panels: Panel) -> Curves:
        """These curves with ``panels`` added below (a command that records more than the one it extends)."""
        return Curves((*self.panels, *panels))

    def plot(
        self,
        records: Sequence[Mapping[str, Any]],
        path: Path,
        *,
        fields: Mapping[str, str] | None = None,
        extra: Sequence[Panel] = (),
    ) -> Path:
        """Draw ``records`` (``{"step", metric: value}``) as a PNG at ``path``; ``fields`` fill the labels,
        ``extra`` panels (a user's own metrics) come after the declared ones."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, drawn = self.draw(records, fields=fields, extra=extra)
        figure.savefig(path, dpi=100, metadata={SERIES_KEY: json.dumps(drawn)})
        plt.close(figure)
        return path

    def draw(
        self,
        records: Sequence[Mapping[str, Any]],
        *,
        fields: Mapping[str, str] | None = None,
        extra: Sequence[Panel] = (),
    ) -> tuple[Any, list[dict[str, Any]]]:
        """The figure and the list of drawn series (``panel``, ``key``, ``label``, ``points``, ``last``)."""
        import matplotlib.pyplot as plt

        shown = [(p, _points(records, p)) for p in (*self.panels, *extra)]
        shown = [(panel, points) for panel, points in shown if points]
        rows = max(len(shown), 1)
        figure, axes = plt.subplots(rows, 1, figsize=(8, 2.4 * rows + 0.6), sharex=True, layout="constrained")
        axes = list(axes) if rows > 1 else [axes]
        drawn: list[dict[str, Any]] = []
        for axis, (panel, points) in zip(axes, shown, strict=False):
            drawn += _draw_panel(axis, panel, points, fields or {})
        axes[-1].set_xlabel("step")
        return figure, drawn


def read_curve_series(path: Path) -> list[dict[str, Any]]:
    """The series a curve PNG holds, as :meth:`Curves.draw` listed them (read from its text chunk)."""
    from PIL import Image

    with Image.open(path) as image:
        text = image.text  # type: ignore[attr-defined]
    return list(json.loads(text.get(SERIES_KEY, "[]")))


def _points(
    records: Sequence[Mapping[str, Any]], panel: Panel
) -> list[tuple[Series, list[int], list[float]]]:
    """Each series of ``panel`` with its finite points (series without one are left out)."""
    found = []
    for series in panel.series:
        pairs = [
            (r["step"], float(r[series.key]))
            for r in records
            if isinstance(r.get(series.key), int | float) and math.isfinite(r[series.key])
        ]
        if pairs:
            found.append((series, [s for s, _ in pairs], [v for _, v in pairs]))
    return found


def _draw_panel(
    axis: Any, panel: Panel, points: list[tuple[Series, list[int], list[float]]], fields: Mapping[str, str]
) -> list[dict[str, Any]]:
    title = panel.title.format_map(fields)
    drawn = []
    for series, steps, values in points:
        label = series.label.format_map(fields)
        axis.plot(steps, values, series.style, label=label, markersize=3)
        drawn.append(
            {"panel": title, "key": series.key, "label": label, "points": len(steps), "last": values[-1]}
        )
    axis.set_title(title, loc="left", fontsize="medium")
    if panel.log_scale and all(v > 0 for _, _, values in points for v in values):
        axis.set_yscale("log")
    if panel.fraction:
        axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return drawn


def train_and_held_out(name: str) -> tuple[Series, Series]:
    """``train/<name>`` per step and ``val/<name>`` per evaluation: one measure, two series."""
    return Series(key=f"train/{name}", label="train"), Series(key=f"val/{name}", label="held-out", style="o-")


LOSS_CURVES = Curves((Panel(title="loss", series=train_and_held_out("loss"), log_scale=True),))
"""The curve of a job that declares none: its training and held-out loss."""

__all__ = [
    "CURVE_FILE",
    "LOSS_CURVES",
    "SERIES_KEY",
    "Curves",
    "Panel",
    "Series",
    "read_curve_series",
    "train_and_held_out",
]
