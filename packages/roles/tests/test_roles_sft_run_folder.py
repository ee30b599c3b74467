"""The run folder tells the truth: resolved config, the untrained model named as such, and a trained model that
plain ``from_pretrained`` loads, that reproduces the engine's log-probs and whose tokenizer reproduces the
training inputs (BOS included) and the run's accuracy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from drivetrain_engine_core.job import create_engine
from drivetrain_engine_core.testing.reference import reference_log_probs
from drivetrain_roles.jobs.batches import StepSampler, make_sft_batch
from drivetrain_roles.jobs.data import load_examples
from drivetrain_roles.jobs.metrics import read_records
from drivetrain_roles.runtime.command_config import to_plain
from drivetrain_roles.sft.config import load_config
from drivetrain_roles.sft.trainer import SFTTrainer
from transformers import AutoModelForCausalLM, AutoTokenizer

OVERRIDES = [
    "data.generated_train_size=128",
    "data.generated_val_size=16",
    "trainer.batch_size=16",
    "trainer.eval_samples=16",
    "trainer.eval_every=0",
    "trainer.max_new_tokens=4",
    "trainer.progress_bar=false",
    "trainer.total_steps=30",
    "trainer.save_every=0",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    config = load_config(None, OVERRIDES)
    output_dir = tmp_path_factory.mktemp("sft") / "run"
    return config, output_dir, SFTTrainer(config, output_dir).run()


def test_resolved_config_is_saved_in_config_yaml_and_summary(run) -> None:
    config, output_dir, _ = run
    saved = yaml.safe_load((output_dir / "config.yaml").read_text())
    assert saved == to_plain(config)
    assert (
        saved["trainer"]["total_steps"] == 30 and saved["optimizer"]["total_steps"] is None
    )  # follows the run
    assert load_config(output_dir / "config.yaml") == config  # a run can be repeated from its folder
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["config"] == saved
    assert summary["final_model"] == str(output_dir / "final_model")


def test_initial_model_is_the_untrained_start_and_final_model_the_trained_one(run) -> None:
    _, output_dir, _ = run
    initial = AutoModelForCausalLM.from_pretrained(output_dir / "initial_model")
    final = AutoModelForCausalLM.from_pretrained(output_dir / "final_model")
    assert not (output_dir / "model").exists()
    name = "lm_head.weight"
    assert not torch.equal(initial.state_dict()[name], final.state_dict()[name])
    assert final.generation_config.do_sample is False and final.generation_config.max_new_tokens == 4


def test_final_model_reproduces_the_engines_log_probs(run) -> None:
    config, output_dir, _ = run
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "final_model")
    examples = load_examples([output_dir / "data" / "val.jsonl"], tokenizer, config.data)[:8]
    batch = make_sft_batch(examples)
    engine = create_engine(
        model_config=dataclasses.replace(config.model, path=str(output_dir / "initial_model")),
        engine_config=config.engine,
        optimizer_config=config.run_optimizer(),
        checkpoint_config=config.checkpoint,
    )
    engine.initialize()
    engine.load_checkpoint(output_dir / "checkpoints")
    with engine.eval_mode():
        engine_log_probs = engine.infer_batch(batch).outputs["log_probs"]
    expected = reference_log_probs(output_dir / "final_model", batch)  # plain from_pretrained, one by one
    torch.testing.assert_close(engine_log_probs.values(), expected.values(), atol=1e-5, rtol=0)


def test_saved_tokenizer_reproduces_training_inputs_and_the_runs_accuracy(run) -> None:
    config, output_dir, result = run
    final_dir = output_dir / "final_model"
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    examples = load_examples([output_dir / "data" / "val.jsonl"], tokenizer, config.data)
    for example in examples:
        assert tokenizer(example.prompt_text)["input_ids"] == example.prompt_ids
        assert example.prompt_ids[0] == tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(final_dir)
    encoded = tokenizer(
        [e.prompt_text for e in examples], return_tensors="pt", padding=True, padding_side="left"
    )
    generated = model.generate(**encoded)
    answers = tokenizer.batch_decode(generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    accuracy = sum(a.strip() == e.response_text for a, e in zip(answers, examples, strict=True)) / len(
        examples
    )
    assert accuracy == result.evaluations[-1]["val/accuracy"]


def test_metrics_report_step_time_and_tokens(run) -> None:
    config, output_dir, _ = run
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "final_model")
    train = load_examples([output_dir / "data" / "train.jsonl"], tokenizer, config.data)
    first_step = StepSampler(len(train), config.trainer.batch_size, config.trainer.seed).global_indices(0)
    first = next(r for r in read_records(output_dir / "metrics.jsonl") if "train/loss" in r)
    assert first["perf/tokens"] == sum(train[i].length for i in first_step.tolist())
    assert first["perf/tokens_per_s"] == pytest.approx(first["perf/tokens"] / first["perf/step_time_s"])
    assert first["perf/tflops_per_device"] > 0
    assert "perf/mfu" not in first, "no MFU on CPU without a configured peak"


def test_checkpoints_hold_the_training_datas_fingerprint(run) -> None:
    _, output_dir, _ = run
    states = [json.loads(p.read_text()) for p in (output_dir / "checkpoints").glob("global_step_*/**/*.json")]
    fingerprints = {state.get("extra_state", {}).get("data_fingerprint") for state in states} - {None}
    assert len(fingerprints) == 1 and len(fingerprints.pop()) == 16


def test_a_resume_on_other_data_is_warned_about(tmp_path, caplog) -> None:
    """Batches are drawn by position from the step, the seed and the data's size, so a resumed run on changed
    data silently trained on other batches than the uninterrupted run's. Each checkpoint stores the data's
    fingerprint; a resume on other data goes on (fixing the data is a reason to) but is warned about."""
    from types import SimpleNamespace

    from drivetrain_roles.jobs.run_folder import RunFolder, data_fingerprint

    data, edited = [[1, 5, 6], [1, 7]], [[1, 5, 6], [1, 8]]
    assert data_fingerprint(data) == data_fingerprint([list(s) for s in data]) != data_fingerprint(edited)
    assert data_fingerprint([[1, 2], [3]]) != data_fingerprint([[1], [2, 3]])  # sequence bounds count
    saved: dict = {}
    engine = SimpleNamespace(
        save_checkpoint=lambda root, step, extra_state: saved.update(extra_state, global_step=step),
        load_checkpoint=lambda root: dict(saved),
    )
    RunFolder(path=tmp_path).for_data(data).save(engine, 4, SimpleNamespace(sync=lambda: None))  # type: ignore[arg-type]
    with caplog.at_level("WARNING"):
        assert RunFolder(path=tmp_path, resume=True).for_data(data).start_step(engine) == 4  # type: ignore[arg-type]
        assert not caplog.text
        assert RunFolder(path=tmp_path, resume=True).for_data(edited).start_step(engine) == 4  # type: ignore[arg-type]
    assert "the training data differ from those the checkpoint" in caplog.text
    assert data_fingerprint(data) in caplog.text and data_fingerprint(edited) in caplog.text


def test_metric_lines_are_on_disk_before_the_checkpoint_that_follows_them(tmp_path, monkeypatch) -> None:
    """Checkpoints are fsynced; ``metrics.jsonl``'s appends only reached the page cache, so after a power loss a
    durable step could lack the metric lines of the steps before it (a gap in the resumed run's curve). The
    records are fsynced before every checkpoint save."""
    import os
    from types import SimpleNamespace

    from drivetrain_roles.jobs.metrics import MetricsWriter
    from drivetrain_roles.jobs.run_folder import RunFolder

    events: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        events.append(f"fsync {Path(os.readlink(f'/proc/self/fd/{fd}')).name}")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"train/loss": 2.0})
    events.clear()  # the new file's own durable creation
    engine = SimpleNamespace(save_checkpoint=lambda root, step, extra_state: events.append(f"save {step}"))
    RunFolder(path=tmp_path).save(engine, 1, writer)  # type: ignore[arg-type]
    assert events == ["fsync metrics.jsonl", "save 1"]


def test_a_kill_while_config_yaml_is_written_leaves_the_previous_one_whole(tmp_path, monkeypatch) -> None:
    """``--resume`` builds the run from its config.yaml; written in place, a kill mid-write left it torn (or
    empty: the resumed run then started from the defaults). It is replaced whole or not at all."""
    from pathlib import Path

    from drivetrain_roles.jobs.run_folder import RunFolder

    previous = "trainer:\n  seed: 1\n"
    (tmp_path / "config.yaml").write_text(previous)
    real = Path.write_text

    def killed_midway(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt  # the process dies with half the text written

    monkeypatch.setattr(Path, "write_text", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        RunFolder(path=tmp_path, resume=True).write_config({"trainer": {"seed": 1, "batch_size": 16}})
    monkeypatch.setattr(Path, "write_text", real)
    assert (tmp_path / "config.yaml").read_text() == previous


class _Tracker:
    def __init__(self, closed: list[str], name: str, fails: bool = False) -> None:
        self.closed, self.name, self.fails = closed, name, fails

    def close(self) -> None:
        self.closed.append(self.name)
        if self.fails:
            raise ConnectionError(f"{self.name} is gone")


def test_every_tracker_is_closed_and_a_failing_one_does_not_hide_the_runs_error(tmp_path):
    """``close`` runs in a ``finally``: a tracker failing to close (a service gone) replaced the run's own error and
    left the trackers after it open."""
    from drivetrain_roles.jobs.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True, report_to=("jsonl",), config={}, resume_step=None)
    closed: list[str] = []
    writer._trackers = [_Tracker(closed, "wandb", fails=True), _Tracker(closed, "jsonl")]
    with pytest.raises(ConnectionError, match="wandb is gone"):
        writer.close()
    assert closed == ["wandb", "jsonl"]
    closed.clear()
    with pytest.raises(ValueError, match="the run's own error"):
        try:
            raise ValueError("the run's own error")
        finally:
            writer.close()
    assert closed == ["wandb", "jsonl"]


def test_tensorboard_events_are_flushed_before_a_checkpoint():
    """``SummaryWriter`` flushes every 120 s: a run killed after a checkpoint lost the steps before it for good."""
    from drivetrain_roles.runtime.tracking.tensorboard import TensorBoardTracker

    tracker = TensorBoardTracker.__new__(TensorBoardTracker)
    flushed: list[bool] = []
    tracker._writer = type("Writer", (), {"flush": lambda self: flushed.append(True)})()
    tracker.sync()
    assert flushed == [True]
