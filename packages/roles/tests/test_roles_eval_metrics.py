"""A user's own held-out measure (``trainer.eval_metrics``): a function of the greedy answers, reported as
``val/<name>`` beside the loss and plotted under it; its value checked against the formula computed here."""

from __future__ import annotations

import json

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.jobs.metrics import read_records
from drivetrain_roles.rm.config import load_config as load_rm_config
from drivetrain_roles.sft.config import load_config
from drivetrain_roles.sft.trainer import SFTTrainer

METRIC = '''
import json, os


def closeness(completions, references):
    """1 / (1 + |answer - reference|) for a numeric answer, None (not applicable) for any other."""
    with open(os.environ["METRIC_LOG"], "a") as log:
        log.write(json.dumps({"completions": completions, "references": references}) + "\\n")
    return [1 / (1 + abs(int(c) - int(r))) if c.strip().isdigit() else None for c, r in zip(completions, references)]
'''


def closeness(answer: str, reference: str) -> float | None:
    return 1 / (1 + abs(int(answer) - int(reference))) if answer.strip().isdigit() else None


def test_a_graded_metric_of_the_held_out_answers_is_reported_and_plotted(
    tmp_path, monkeypatch, plotted
) -> None:
    (tmp_path / "metric.py").write_text(METRIC)
    monkeypatch.setenv("METRIC_LOG", str(tmp_path / "calls.jsonl"))
    config = load_config(
        None,
        [
            f"trainer.eval_metrics=[{tmp_path / 'metric.py'}:closeness]",
            "data.generated_train_size=64",
            "data.generated_val_size=16",
            "trainer.batch_size=16",
            "trainer.eval_samples=12",
            "trainer.total_steps=3",
            "trainer.eval_every=0",
            "trainer.max_new_tokens=4",
            "trainer.progress_bar=false",
            "optimizer.lr=1e-2",
        ],
    )
    run = tmp_path / "run"
    SFTTrainer(config, run).run()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    evaluations = [r for r in read_records(run / "metrics.jsonl") if "val/loss" in r]
    assert len(calls) == len(evaluations) == 2  # steps 0 and 3
    graded = 0
    for call, record in zip(calls, evaluations, strict=True):
        pairs = list(zip(call["completions"], call["references"], strict=True))
        assert len(pairs) == 12
        # The function saw the answers the job's exact match was measured on.
        assert record["val/accuracy"] == pytest.approx(sum(a.strip() == r for a, r in pairs) / 12)
        scores = [s for s in (closeness(a, r) for a, r in pairs) if s is not None]
        if scores:
            assert record["val/closeness"] == pytest.approx(sum(scores) / len(scores), abs=1e-12)
            graded += any(0 < s < 1 for s in scores)
        else:
            assert "val/closeness" not in record
    assert graded  # some answer was near but not right: the measure is graded, not exact match again
    series = plotted(run / "loss_curve.png")
    assert series["val/closeness"]["panel"] == "held-out answers: your measures (trainer.eval_metrics)"
    assert series["val/loss"]["panel"].startswith("SFT loss")


def test_a_metric_that_cannot_load_or_overwrites_a_measure_is_refused_before_any_work(tmp_path) -> None:
    (tmp_path / "metric.py").write_text("def accuracy(completions):\n    return [0.0 for _ in completions]\n")
    for spec, message in [
        (f"{tmp_path / 'metric.py'}:nothing", r"trainer.eval_metrics=.*has no function 'nothing'"),
        (f"{tmp_path / 'metric.py'}:accuracy", r"'accuracy' would overwrite the job's own val/accuracy"),
    ]:
        config = load_config(None, [f"trainer.eval_metrics=[{spec}]"])
        with pytest.raises(ConfigError, match=message):
            SFTTrainer(config, tmp_path / "run")
    with pytest.raises(ConfigError, match="a reward model generates no answers"):
        load_rm_config(None, ["trainer.eval_metrics=[exact_match]"])
