"""The divergence guard (``trainer.divergence``): over recorded step records, and in a run whose learning rate
is far too high.

Regression: ``drivetrain sft optimizer.lr=100`` trained 30 steps (held-out loss 2.86 -> 2,343,977), printed
"trained model: ..." and exited 0 without a warning; ``optimizer.lr=0`` trained nothing, silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.jobs.config_reference import reference_page
from drivetrain_roles.jobs.divergence import DivergenceConfig, DivergenceGuard, Trip
from drivetrain_roles.jobs.metrics import read_records
from drivetrain_roles.sft.config import load_config
from drivetrain_roles.sft.trainer import SFTTrainer

RECORDED = json.loads((Path(__file__).parent / "data" / "default_run_metrics.json").read_text())["runs"]
"""Every embedded job's default run (and its SFT warm start), step by step: see the file's ``about``."""

LR_100 = {
    "train/loss": [2.859, 15720.7, 95595.5, 178299.4, 281605.8, 427135.2],
    "train/grad_norm": [4.060, 308.3, 979.7, 429672.6, 67649016.0, 439540160.0],
    "train/lr": [33.3, 66.7, 100.0, 100.0, 99.7, 98.8],
}
"""The first steps of ``drivetrain sft optimizer.lr=100 trainer.total_steps=30`` as it ran before the guard."""
GRPO_LR_1 = {"train/grad_norm": [0.3311, 0.003716, 0.0007896, 0.0006275, 1.897e-13, 5.459e-15]}
"""The first steps of ``drivetrain grpo optimizer.lr=1 trainer.total_steps=20``: held-out accuracy 0.225 -> 0.005,
entropy 1.04 -> 1e-16."""


def records(series: dict[str, list[float | None]]) -> list[dict[str, float]]:
    """Step records (1-based ``step``) from per-metric series; ``None`` leaves the metric out of a step."""
    steps = len(next(iter(series.values())))
    return [
        {
            "step": step,
            **{key: values[step - 1] for key, values in series.items() if values[step - 1] is not None},
        }
        for step in range(1, steps + 1)
    ]


def trips(steps: list[dict[str, float]], **config: object) -> list[Trip]:
    guard = DivergenceGuard(DivergenceConfig(**config))  # type: ignore[arg-type]
    return [trip for record in steps if (trip := guard.check(record["step"], record)) is not None]


@pytest.mark.parametrize("run", sorted(RECORDED))
def test_the_embedded_jobs_default_runs_never_trip_the_default_guard(run) -> None:
    assert trips(records(RECORDED[run])) == []


def test_the_default_has_margin_and_the_check_is_live_on_the_recorded_runs() -> None:
    """At a third of the default factor rm's spiky grad norm trips it (its run passes only factors above 4.45)."""
    tripped = {run for run in RECORDED if trips(records(RECORDED[run]), factor=10 / 3)}
    assert tripped == {"rm"}


def test_a_learning_rate_of_100_trips_the_guard_once_from_its_second_step() -> None:
    found = trips(records(LR_100))
    assert [(t.step, t.since, t.first) for t in found] == [(4, 2, True), (5, 2, False), (6, 2, False)]
    assert found[0].metric == "train/grad_norm" and found[0].baseline == 4.060
    assert found[0].record() == {"guard/divergence_ratio": 429672.6 / 4.060}


def test_a_policy_collapsed_by_a_learning_rate_of_1_trips_it() -> None:
    found = trips(records(GRPO_LR_1))
    assert [(t.step, t.kind, t.since, t.first) for t in found] == [
        (4, "collapsed", 2, True),
        (5, "collapsed", 2, False),
        (6, "collapsed", 2, False),
    ]
    assert "the updates have collapsed" in found[0].describe()


def test_a_learning_rate_of_0_trips_it_after_patience_steps() -> None:
    steps = records({"train/loss": [2.0] * 6, "train/lr": [0.0, 0.0, 0.0, 0.0, 1e-3, 0.0]})
    found = trips(steps)
    assert [(t.step, t.kind, t.since, t.first) for t in found] == [
        (3, "stalled", 1, True),
        (4, "stalled", 1, False),
    ]
    assert found[1].record() == {"guard/zero_lr_steps": 4.0}


def test_single_spikes_pass_and_never_enter_the_baseline_and_each_episode_counts_once() -> None:
    loss = [1.0] * 10 + [1000.0, 1000.0, 1.0] + [1000.0] * 4 + [1.0] + [50.0] * 3
    found = trips(records({"train/loss": loss}))
    # Two spikes, then one step below: no trip. A streak of four: tripped from its third step. The baseline is
    # still 1 (no spike entered it): 50x trips again, a second episode.
    assert [(t.step, t.since, t.first) for t in found] == [(16, 14, True), (17, 14, False), (21, 19, True)]
    assert {t.baseline for t in found} == {1.0}


def test_a_resumed_guard_replays_the_records_and_goes_on_as_the_uninterrupted_one() -> None:
    steps = records({"train/loss": [1.0] * 10 + [1000.0] * 5 + [1.0] * 3})
    resumed = DivergenceGuard(DivergenceConfig())
    resumed.replay(steps[:13])  # resumed in the middle of an episode that began before it
    later = [trip for record in steps[13:] if (trip := resumed.check(record["step"], record)) is not None]
    assert later == [t for t in trips(steps) if t.step > 13]
    assert [(t.step, t.since, t.first) for t in later] == [(14, 11, False), (15, 11, False)]
    assert [t.step for t in resumed.episodes] == [13]


def test_off_never_trips_and_bad_settings_name_the_field() -> None:
    assert trips(records(LR_100), action="off") == []
    with pytest.raises(ConfigError, match=r"trainer\.divergence\.factor must be > 1 .* got 1\.0"):
        load_config(None, ["trainer.divergence.factor=1.0"])
    with pytest.raises(ConfigError, match=r"trainer\.divergence\.patience must be >= 1, got 0"):
        load_config(None, ["trainer.divergence.patience=0"])
    assert "trainer.divergence.action: 'warn' | 'stop' | 'off' = warn" in reference_page("sft")


TINY = [
    "data.generated_train_size=64",
    "data.generated_val_size=8",
    "trainer.batch_size=16",
    "trainer.eval_samples=4",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.max_new_tokens=2",
    "trainer.progress_bar=false",
    "trainer.total_steps=6",
    "optimizer.lr=100",
]


@pytest.mark.slow
def test_a_run_at_lr_100_warns_once_and_records_the_trip(tmp_path, capfd) -> None:
    job = SFTTrainer(load_config(None, TINY), tmp_path)
    result = job.run()
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("drivetrain sft: warning: step 4: train/grad_norm=")
    assert "the run is diverging" in warnings[0] and "lower optimizer.lr" in warnings[0]
    steps = [r for r in read_records(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps if "guard/divergence_ratio" in r] == [4, 5, 6]
    assert all(r["guard/divergence_ratio"] > 1000 for r in steps if "guard/divergence_ratio" in r)
    guard = json.loads((tmp_path / "summary.json").read_text())["divergence_guard"]
    assert (guard["action"], guard["tripped"], len(guard["episodes"])) == ("warn", True, 1)
    assert (guard["episodes"][0]["step"], guard["episodes"][0]["since"]) == (4, 2)
    assert "warning: step 4: train/grad_norm=" in job.report(result)
