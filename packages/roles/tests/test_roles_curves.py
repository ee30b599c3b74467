"""The curve module: what it draws, what it leaves out, where the legends go, what the PNG says it holds."""

from __future__ import annotations

import math

from drivetrain_roles.jobs.curves import Curves, Panel, Series, read_curve_series, train_and_held_out

CURVES = Curves(
    (
        Panel(title="loss ({kind})", series=train_and_held_out("loss"), log_scale=True),
        Panel(title="accuracy", series=(Series(key="val/accuracy", label="held-out"),), fraction=True),
        Panel(title="never recorded", series=(Series(key="train/kl", label="kl"),)),
    )
)
RECORDS = [
    {"step": 0, "val/loss": 2.0, "val/accuracy": 0.0},
    {"step": 1, "train/loss": 1.5},
    {"step": 2, "train/loss": None},  # a skipped step: written as null, not drawn
    {"step": 3, "train/loss": math.inf},
    {"step": 4, "train/loss": 0.5, "val/loss": 0.7, "val/accuracy": 0.75},
]


def test_the_png_lists_each_drawn_series_and_leaves_out_panels_without_points(tmp_path) -> None:
    path = CURVES.plot(RECORDS, tmp_path / "curve.png", fields={"kind": "DPO sigmoid"})
    series = read_curve_series(path)
    assert [(s["panel"], s["key"], s["label"], s["points"], s["last"]) for s in series] == [
        ("loss (DPO sigmoid)", "train/loss", "train", 2, 0.5),
        ("loss (DPO sigmoid)", "val/loss", "held-out", 2, 0.7),
        ("accuracy", "val/accuracy", "held-out", 2, 0.75),
    ]


def test_legends_sit_beside_their_axes_inside_the_figure() -> None:
    """A legend laid over the figure's top covered the frame and the curves (issue #48)."""
    figure, _ = CURVES.draw(RECORDS, fields={"kind": "x"})
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    frame = figure.bbox
    axes = figure.get_axes()
    assert len(axes) == 2  # the KL panel had no point
    for axis in axes:
        legend = axis.get_legend().get_window_extent(renderer)
        assert legend.x0 >= axis.get_window_extent(renderer).x1  # right of the plotting area, not over it
        assert (
            frame.x0 <= legend.x0
            and legend.x1 <= frame.x1
            and frame.y0 <= legend.y0
            and legend.y1 <= frame.y1
        )
    assert axes[1].get_ylim() == (-0.02, 1.02)
    assert axes[0].get_yscale() == "log"
