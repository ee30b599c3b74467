"""``report_to`` trackers: JSONL by default, others dispatched by name, missing libraries named with the fix."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.runtime.tracking import RunInfo, check_report_to, open_trackers, read_records


def _run(tmp_path, resume_step=None) -> RunInfo:
    return RunInfo(
        run_dir=tmp_path, name="sft-x", config={"trainer": {"total_steps": 3}}, resume_step=resume_step
    )


def _fake_module(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in attributes.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_jsonl_keeps_records_up_to_the_resumed_step(tmp_path) -> None:
    (tracker,) = open_trackers(["jsonl"], _run(tmp_path))
    for step in (1, 2, 3):
        tracker.log(step, {"train/loss": float(step)})
    open_trackers(["jsonl"], _run(tmp_path, resume_step=2))
    assert read_records(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/loss": 1.0},
        {"step": 2, "train/loss": 2.0},
    ]


def test_wandb_and_mlflow_receive_config_and_every_record(tmp_path, monkeypatch) -> None:
    calls: list[tuple] = []

    class FakeWandbRun:
        def log(self, values, step):
            calls.append(("wandb.log", step, values))

        def finish(self):
            calls.append(("wandb.finish",))

    def wandb_init(**kwargs):
        calls.append(("wandb.init", kwargs["name"], kwargs["config"]))
        return FakeWandbRun()

    def start_run(run_name):
        calls.append(("mlflow.start_run", run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlflow-1"))

    _fake_module(monkeypatch, "wandb", init=wandb_init)
    _fake_module(
        monkeypatch,
        "mlflow",
        start_run=start_run,
        log_params=lambda params: calls.append(("mlflow.log_params", params)),
        log_metrics=lambda values, step: calls.append(("mlflow.log_metrics", step, values)),
        end_run=lambda: calls.append(("mlflow.end_run",)),
    )
    trackers = open_trackers(["jsonl", "wandb", "mlflow"], _run(tmp_path))
    for tracker in trackers:
        tracker.log(1, {"train/loss": 0.5})
        tracker.close()
    assert calls == [
        ("wandb.init", "sft-x", {"trainer": {"total_steps": 3}}),
        ("mlflow.start_run", "sft-x"),
        ("mlflow.log_params", {"trainer.total_steps": 3}),
        ("wandb.log", 1, {"train/loss": 0.5}),
        ("wandb.finish",),
        ("mlflow.log_metrics", 1, {"train/loss": 0.5}),
        ("mlflow.end_run",),
    ]
    assert read_records(tmp_path / "metrics.jsonl") == [{"step": 1, "train/loss": 0.5}]


def test_unknown_or_missing_trackers_name_the_fix(monkeypatch) -> None:
    with pytest.raises(
        ConfigError, match=r"trainer.report_to names 'tensorbord'.*Did you mean 'tensorboard'"
    ):
        check_report_to(["tensorbord"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"'mlflow' package is not installed; pip install mlflow"):
        check_report_to(["jsonl", "mlflow"])


def test_a_line_cut_short_is_skipped_not_fatal_on_resume(tmp_path, caplog) -> None:
    """An append cut short by a crash or a full disk (a partial line, NUL bytes) made every later read raise
    JSONDecodeError, so the run could not resume until someone edited the file by hand."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 2.0}\n\x00\x00{"step": 3, "tr')
    with caplog.at_level("WARNING"):
        open_trackers(["jsonl"], _run(tmp_path, resume_step=2))
    assert read_records(path) == [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 2.0}]
    assert "skipped 1 line(s)" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left


def test_a_resumed_run_continues_its_wandb_mlflow_and_tensorboard_runs(tmp_path, monkeypatch) -> None:
    """A resumed run started a new W&B and a new MLflow run, and TensorBoard showed the steps the crashed run
    logged after the checkpoint twice. Now the W&B and MLflow run ids are kept in the run directory and a
    resume continues those runs (MLflow params, which cannot change, are logged once), and TensorBoard purges
    what came after the resumed step. A new run purges from step 0: event files of an earlier run in the
    directory (``--overwrite``) mixed into its curves."""
    calls: list[tuple] = []
    _fake_module(
        monkeypatch, "wandb", init=lambda **kwargs: calls.append(("wandb", kwargs["id"], kwargs["resume"]))
    )

    def start_run(run_name=None, run_id=None):
        calls.append(("mlflow", run_name, run_id))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlflow-1"))

    _fake_module(
        monkeypatch,
        "mlflow",
        start_run=start_run,
        log_params=lambda params: calls.append(("mlflow.log_params",)),
    )
    _fake_module(monkeypatch, "tensorboard")
    _fake_module(
        monkeypatch,
        "torch.utils.tensorboard",
        SummaryWriter=lambda log_dir, purge_step: calls.append(("tensorboard", purge_step)),
    )
    open_trackers(["wandb", "mlflow", "tensorboard"], _run(tmp_path))
    open_trackers(["wandb", "mlflow", "tensorboard"], _run(tmp_path, resume_step=200))
    new_id = calls[0][1]
    assert calls == [
        ("wandb", new_id, "allow"),
        ("mlflow", "sft-x", None),
        ("mlflow.log_params",),
        ("tensorboard", 0),
        ("wandb", new_id, "allow"),
        ("mlflow", None, "mlflow-1"),
        ("tensorboard", 201),
    ]


def test_a_stored_run_id_the_service_refuses_starts_a_new_run(tmp_path, monkeypatch, caplog) -> None:
    """A resumed run whose W&B or MLflow run was deleted raised on the output rank alone (the others then
    waited in a collective); it now starts a new run there, with a warning."""
    calls: list[tuple] = []

    def wandb_init(**kwargs):
        if kwargs["id"] == "gone":
            raise RuntimeError("run gone was deleted")
        calls.append(("wandb", kwargs["id"]))

    def start_run(run_name=None, run_id=None):
        if run_id is not None:
            raise RuntimeError(f"Run '{run_id}' not found")
        calls.append(("mlflow", run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="mlflow-2"))

    _fake_module(monkeypatch, "wandb", init=wandb_init)
    _fake_module(monkeypatch, "mlflow", start_run=start_run, log_params=lambda params: None)
    (tmp_path / ".wandb_run_id").write_text("gone")
    (tmp_path / ".mlflow_run_id").write_text("mlflow-1")
    with caplog.at_level("WARNING"):
        open_trackers(["wandb", "mlflow"], _run(tmp_path, resume_step=5))
    new_id = (tmp_path / ".wandb_run_id").read_text()
    assert calls == [("wandb", new_id), ("mlflow", "sft-x")] and new_id != "gone"
    assert (tmp_path / ".mlflow_run_id").read_text() == "mlflow-2"
    assert "did not resume run gone" in caplog.text and "did not resume run mlflow-1" in caplog.text
