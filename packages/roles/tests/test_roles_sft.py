"""The SFT trainer on the real FSDP backend: it learns, resumes bit-exactly, and rejects bad input clearly."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core.backend import CheckpointError, ConfigError, PluginError
from drivetrain_engine_core.job import DivergenceError
from drivetrain_roles.jobs.assets import ModelPathError
from drivetrain_roles.jobs.curves import LOSS_CURVES
from drivetrain_roles.jobs.data import DataError
from drivetrain_roles.jobs.default_assets import BUILTIN_MODEL, write_model_dir
from drivetrain_roles.jobs.launch import spawn_ranks
from drivetrain_roles.jobs.metrics import MetricsWriter, read_records
from drivetrain_roles.sft.config import load_config
from drivetrain_roles.sft.trainer import SFTTrainer

SMALL = [
    "data.generated_train_size=128",
    "data.generated_val_size=16",
    "trainer.batch_size=16",
    "trainer.eval_samples=8",
    "trainer.eval_every=0",
    "trainer.max_new_tokens=4",
    "trainer.progress_bar=false",
    "optimizer.lr=5e-3",
]


def run_sft(output_dir, *overrides, resume=False, overwrite=False):
    config = load_config(None, [*SMALL, *overrides])
    return SFTTrainer(config, output_dir, resume=resume, overwrite=overwrite).run()


STEPS = ["trainer.total_steps=8", "trainer.save_every=4"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("sft") / "full"
    return output_dir, run_sft(output_dir, *STEPS)


@pytest.mark.slow
def test_sft_lowers_the_loss_and_writes_its_metrics(full_run) -> None:
    full_dir, full = full_run
    assert len(full.train_losses) == 8
    assert sum(full.train_losses[-3:]) / 3 < sum(full.train_losses[:3]) / 3 - 0.2
    before, after = full.evaluations[0], full.evaluations[-1]
    assert (before["step"], after["step"]) == (0, 8)
    assert after["val/loss"] < before["val/loss"] - 0.2
    assert 0.0 <= after["val/accuracy"] <= 1.0
    assert (full_dir / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    records = read_records(full_dir / "metrics.jsonl")
    assert [r["train/loss"] for r in records if "train/loss" in r] == full.train_losses
    assert json.loads((full_dir / "summary.json").read_text())["final_train_loss"] == full.train_losses[-1]
    assert [r["train/skipped_steps"] for r in records if "train/loss" in r] == [0.0] * 8
    assert json.loads((full_dir / "summary.json").read_text())["skipped_steps"] == 0


def test_the_curve_shows_the_sft_loss_its_perplexity_and_exact_match(full_run, plotted) -> None:
    """Each series of the curve is the metric it is labelled as, read from the PNG's metadata."""
    series = plotted(full_run[0] / "loss_curve.png")
    assert set(series) == {"train/loss", "val/loss", "val/perplexity", "val/accuracy"}
    loss_panel = "SFT loss: cross-entropy of the response tokens (token-mean)"
    assert series["train/loss"]["panel"] == series["val/loss"]["panel"] == loss_panel
    assert (series["train/loss"]["points"], series["val/loss"]["points"]) == (8, 2)
    assert series["val/perplexity"]["last"] == pytest.approx(math.exp(series["val/loss"]["last"]))
    assert series["val/accuracy"]["panel"].startswith("held-out accuracy")


@pytest.mark.slow
def test_a_resumed_run_reproduces_the_uninterrupted_one_exactly(full_run, tmp_path) -> None:
    full_dir, full = full_run
    resumed_dir = tmp_path / "resumed"
    _cut_back_to_step_4(full_dir, resumed_dir)  # the run "crashed" after its step-4 checkpoint
    resumed = run_sft(resumed_dir, *STEPS, resume=True)
    assert resumed.start_step == 4
    assert resumed.train_losses == full.train_losses[4:]  # bit-exact, not approximately
    # The whole run's evaluations (step 0's read back from metrics.jsonl): the summary starts at step 0.
    assert resumed.evaluations == full.evaluations and resumed.evaluations[0]["step"] == 0
    resumed_records = read_records(resumed_dir / "metrics.jsonl")
    assert [r["train/loss"] for r in resumed_records if "train/loss" in r] == full.train_losses


def _cut_back_to_step_4(full_dir: Path, run_dir: Path) -> None:
    """``run_dir``: the full run as it was after its step-4 checkpoint (what came later dropped)."""
    shutil.copytree(full_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "global_step_8")
    (run_dir / "checkpoints" / "latest").write_text("global_step_4")
    shutil.rmtree(run_dir / "final_model")
    (run_dir / "summary.json").unlink()


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_the_resumed_run_reproduces_the_uninterrupted_one(
    full_run, tmp_path, monkeypatch
) -> None:
    """Ctrl-C exited with 130 and lost every step since the last save (up to ``save_every - 1``): the first one
    now finishes the step, saves it, names it, and ``--resume`` from there ends as the uninterrupted run, bit for
    bit."""
    from safetensors.torch import load_file

    full_dir, full = full_run
    run_dir = tmp_path / "interrupted"
    step = SFTTrainer._step

    def ctrl_c_during_step_5(self, index, result):
        if index == 4:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in a terminal sends
        return step(self, index, result)

    monkeypatch.setattr(SFTTrainer, "_step", ctrl_c_during_step_5)
    stopped = CliRunner().invoke(drivetrain_cli, ["sft", "--output-dir", str(run_dir), *SMALL, *STEPS])
    monkeypatch.undo()
    saved = run_dir / "checkpoints" / "global_step_5"
    assert (stopped.exit_code, stopped.stderr) == (
        130,
        f"drivetrain sft: interrupted after step 5 of 8; saved checkpoint {saved}. Continue with: drivetrain sft "
        f"--resume --output-dir {run_dir}\n",
    )
    assert sorted(p.name for p in saved.parent.iterdir()) == ["global_step_4", "global_step_5", "latest"]
    assert not (run_dir / "final_model").exists() and not (run_dir / "summary.json").exists()

    resumed = run_sft(run_dir, *STEPS, resume=True)
    assert resumed.start_step == 5
    assert resumed.train_losses == full.train_losses[5:]  # bit-exact
    assert resumed.evaluations == full.evaluations
    records = read_records(run_dir / "metrics.jsonl")
    assert [r["train/loss"] for r in records if "train/loss" in r] == full.train_losses
    weights, expected = (load_file(d / "final_model" / "model.safetensors") for d in (run_dir, full_dir))
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.slow
def test_the_guard_stops_a_diverging_run_naming_the_last_checkpoint_before_it(full_run, tmp_path) -> None:
    """Resumed after step 4 at ``optimizer.lr=100``: step 5's update ruins the weights, steps 6-8 measure it."""
    run_dir = tmp_path / "diverging"
    _cut_back_to_step_4(full_run[0], run_dir)
    stop = [
        "trainer.total_steps=12",
        "trainer.save_every=4",
        "optimizer.lr=100",
        "trainer.divergence.action=stop",
    ]
    with pytest.raises(DivergenceError) as raised:
        run_sft(run_dir, *stop, resume=True)
    message = str(raised.value)
    assert message.startswith("step 8: train/")
    assert "(outside the guard's lines since step 6): the run is diverging" in message
    assert message.endswith(
        "Stopped (trainer.divergence.action=stop); the last checkpoint before the divergence: "
        f"{run_dir / 'checkpoints' / 'global_step_4'}."
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["global_step_4", "latest"]
    assert not (run_dir / "final_model").exists() and not (run_dir / "summary.json").exists()


def test_non_finite_metrics_are_written_as_valid_json(tmp_path) -> None:
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(1, {"train/loss": float("nan"), "train/grad_norm": float("inf"), "train/skipped_steps": 1.0})
    writer.write(2, {"train/loss": 0.5, "train/grad_norm": 1.0, "train/skipped_steps": 1.0})
    writer.close()

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert records[0] == {"step": 1, "train/loss": None, "train/grad_norm": None, "train/skipped_steps": 1.0}
    LOSS_CURVES.plot(records, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_a_new_run_refuses_a_directory_with_checkpoints_and_resume_needs_one(full_run, tmp_path) -> None:
    full_dir, _ = full_run
    metrics = (full_dir / "metrics.jsonl").read_text()
    with pytest.raises(
        CheckpointError, match=r"already holds checkpoints of a run \(global_step_4, global_step_8\)"
    ):
        run_sft(full_dir, *STEPS)
    assert (full_dir / "metrics.jsonl").read_text() == metrics  # nothing truncated, nothing pruned
    assert sorted(p.name for p in (full_dir / "checkpoints").iterdir()) == [
        "global_step_4",
        "global_step_8",
        "latest",
    ]
    with pytest.raises(CheckpointError, match=r"--resume: .* holds no complete checkpoint.*Drop --resume"):
        run_sft(tmp_path / "empty", *STEPS, resume=True)
    result = CliRunner().invoke(drivetrain_cli, ["sft", "--resume", "--output-dir", str(tmp_path / "empty")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "holds no complete checkpoint" in result.output
    overwritten = tmp_path / "overwritten"
    shutil.copytree(full_dir, overwritten)
    run_sft(overwritten, "trainer.total_steps=1", overwrite=True)
    assert sorted(p.name for p in (overwritten / "checkpoints").iterdir()) == ["global_step_1", "latest"]


def test_resume_starts_from_the_runs_own_config(full_run) -> None:
    """``--resume`` built the config from the defaults and the resume command's overrides alone: the run went
    on with other data sizes, model and learning rate on the first part's checkpoint, and its config.yaml was
    rewritten to say so. It now starts from the run's config.yaml; overrides go on top."""
    import click
    from drivetrain_roles.jobs.run_options import run_options
    from drivetrain_roles.runtime.command_config import config_options

    full_dir, _ = full_run
    seen = []

    @click.command()
    @run_options("sft")
    @config_options("drivetrain_roles.sft.config:SFTConfig")
    def probe(config_file, run, overrides):
        seen.append((load_config(config_file, overrides), run.output_dir))

    result = CliRunner().invoke(probe, ["--resume", "--output-dir", str(full_dir), "trainer.total_steps=12"])
    assert result.exit_code == 0, result.output
    config, output_dir = seen[0]
    assert config.data.generated_train_size == 128 and config.trainer.batch_size == 16  # the run's (SMALL)
    assert config.trainer.total_steps == 12 and output_dir == str(full_dir)
    # --print-config shows what the resumed run would use, not the defaults
    printed = CliRunner().invoke(
        drivetrain_cli,
        ["sft", "--print-config", "--resume", "--output-dir", str(full_dir), "trainer.total_steps=12"],
    )
    assert printed.exit_code == 0, printed.output
    assert yaml.safe_load(printed.output)["data"]["generated_train_size"] == 128


def test_a_refused_resume_leaves_the_run_folder_as_it_was(full_run, tmp_path, folder_state) -> None:
    """A resume refused at its checkpoint (other data-order values) had already rewritten config.yaml with the
    refused overrides, so the run no longer resumed as saved; config.yaml is written once the checkpoint has
    loaded, and a resume that is not refused still records its overrides. A resume from another model of the
    same shape was not refused at all: it trained on with that model's tokenizer and config (the start check of
    dpo, rm, grpo and ppo, jobs.resume_start, now runs first for sft too)."""
    full_dir, _ = full_run
    run_dir = tmp_path / "run"
    shutil.copytree(full_dir, run_dir)
    before = folder_state(run_dir)
    other = write_model_dir(tmp_path / "other", seed=4)
    refusals = {
        "trainer.seed=7": [
            "trained with trainer.seed=0, this run has 7; resume with the same value or start a new"
        ],
        f"model.path={other}": [
            f"the run in {run_dir} started from model.path={BUILTIN_MODEL} ({run_dir / 'config.yaml'}), this "
            f"--resume from model.path={other};",
            f"Resume with model.path={BUILTIN_MODEL}, or start a new run without --resume.",
        ],
    }
    for override, messages in refusals.items():
        result = CliRunner().invoke(
            drivetrain_cli, ["sft", "--resume", "--output-dir", str(run_dir), override]
        )
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert all(message in result.output for message in messages), result.output
        assert folder_state(run_dir) == before
    resumed = CliRunner().invoke(
        drivetrain_cli, ["sft", "--resume", "--output-dir", str(run_dir), "trainer.max_new_tokens=3"]
    )
    assert resumed.exit_code == 0, resumed.output
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["max_new_tokens"] == 3


@pytest.mark.slow
def test_cli_with_two_spawned_ranks_trains_like_one_rank(full_run, tmp_path) -> None:
    _, full = full_run
    output_dir = tmp_path / "two_ranks"
    result = CliRunner().invoke(
        drivetrain_cli, ["sft", "--nproc", "2", "--output-dir", str(output_dir), *SMALL, *STEPS]
    )
    assert result.exit_code == 0, result.output
    records = read_records(output_dir / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert losses == pytest.approx(full.train_losses, rel=1e-4)


@pytest.mark.slow
def test_a_user_error_under_nproc_is_one_line_from_one_rank(tmp_path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n[1, 2]\n')
    drivetrain = Path(sys.executable).parent / "drivetrain"
    command = [
        drivetrain,
        "sft",
        "--nproc",
        "2",
        "--output-dir",
        tmp_path / "run",
        f"data.train_files=[{data}]",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"drivetrain sft: error: {data}:2 is a JSON list, not an object; write one object per line, such as "
        '{"prompt": "...", "response": "..."}.'
    ], done.stderr
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr


def test_ctrl_c_ends_the_launcher_quietly(monkeypatch, capsys) -> None:
    """(A rank's own Ctrl-C: test_roles_rank_main.)"""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher import api

    def launch(config, entrypoint):
        def run(*args):
            raise SignalException("got signal: 2", sigval=signal.SIGINT)

        return run

    monkeypatch.setattr(api, "elastic_launch", launch)
    assert spawn_ranks(2, ["--output-dir", "x"], "sft", Path("x")) == 130
    assert capsys.readouterr().err == "drivetrain sft: interrupted; every rank was stopped.\n"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("rows", "overrides", "message"),
    [
        ([{"question": "1+1=", "response": "2"}], [], "no column 'prompt'"),
        ([], [], "is empty"),
        (
            [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+1=", "response": "22222222"}],
            ["data.max_length=8"],
            "token budget",
        ),
    ],
    ids=["missing_column", "empty", "too_long"],
)
def test_bad_data_gives_one_clear_error(tmp_path, rows, overrides, message) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=message):
        run_sft(tmp_path / "run", f"data.train_files=[{train}]", *overrides)


def test_a_model_that_sft_cannot_train_is_refused_before_training(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"model.model_type='value_model' has no next-token log-probs"):
        SFTTrainer(load_config(None, ["model.model_type=value_model"]), tmp_path / "run")
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(ModelPathError, match=r"not_a_model has no config.json"):
        run_sft(tmp_path / "run", f"model.path={tmp_path / 'not_a_model'}")


def test_unknown_backend_names_the_installed_ones() -> None:
    with pytest.raises(PluginError, match=r"(?s)'nope'.*fsdp"):
        load_config(None, ["engine.backend=nope"])


def test_cli_reports_bad_config_in_one_line(tmp_path) -> None:
    runner = CliRunner()
    result = runner.invoke(drivetrain_cli, ["sft", "--output-dir", str(tmp_path), "trainer.batch_size=0"])
    assert result.exit_code == 1
    assert "trainer.batch_size must be >= 1" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(drivetrain_cli, ["sft", "--output-dir", str(tmp_path), "trainer.nope=1"])
    assert result.exit_code == 1 and "unknown option trainer.nope" in result.output


def test_a_save_cut_short_before_publication_is_not_a_checkpoint(tmp_path) -> None:
    """A save that wrote its manifest but died before the rename leaves ``.tmp-global_step_N`` complete. No
    resume can load it; counting it accepted ``--resume`` (which then failed with "no checkpoint to load") and
    refused a new run there."""
    from drivetrain_roles.jobs.launch import check_run_dir

    temporary = tmp_path / "checkpoints" / ".tmp-global_step_4"
    temporary.mkdir(parents=True)
    (temporary / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        check_run_dir(tmp_path, resume=True, overwrite=False)
    check_run_dir(tmp_path, resume=False, overwrite=False)  # a new run may start here


@pytest.mark.parametrize("overwrite", [False, True])
def test_overwrite_clears_the_previous_runs_results_too(tmp_path, overwrite) -> None:
    """``--overwrite`` deleted the previous run's checkpoints only: its ``summary.json`` and ``final_model/``
    stayed and described the new run until it finished (for ever, if it crashed). A new run without
    ``--overwrite`` (allowed where no checkpoint is) deletes nothing."""
    from drivetrain_roles.jobs.run_folder import RunFolder

    previous = [
        "checkpoints/global_step_9/model.pt",
        "final_model/model.safetensors",
        "summary.json",
        "metrics.jsonl",
        "data/x",
    ]
    for name in previous:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("previous run")
    RunFolder(path=tmp_path, overwrite=overwrite).prepare({"trainer": {"seed": 1}})
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert kept == (["config.yaml", "data/x"] if overwrite else sorted([*previous, "config.yaml"]))


def test_a_resume_without_the_jsonl_tracker_reads_no_stale_metrics(tmp_path) -> None:
    """A resumed run read ``metrics.jsonl`` even without the jsonl tracker, so a file an earlier run left in
    the folder fed its evaluations into the new run's summary and loss curve."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val/loss": 9.99}\n{"step": 2, "val/loss": 8.88}\n')
    assert MetricsWriter(tmp_path, enabled=True, report_to=(), resume_step=2).earlier_evaluations() == []
    with_jsonl = MetricsWriter(tmp_path, enabled=True, report_to=("jsonl",), resume_step=2)
    assert with_jsonl.earlier_evaluations() == [{"step": 0, "val/loss": 9.99}, {"step": 2, "val/loss": 8.88}]


def test_a_held_out_set_smaller_than_the_data_parallel_ranks_is_refused(monkeypatch) -> None:
    """Each data-parallel rank scores a share of the held-out set: with 3 examples on 4 ranks one rank had
    none and failed while the others waited in a collective."""
    from drivetrain_engine_core.backend import EngineConfig
    from drivetrain_roles.jobs import batches
    from drivetrain_roles.jobs.batches import check_held_out_size

    monkeypatch.setattr(batches.distributed, "world_size", lambda group=None: 4)
    with pytest.raises(DataError, match="held-out set has 3 examples, fewer than the 4 data-parallel ranks"):
        check_held_out_size(3, EngineConfig())
    check_held_out_size(0, EngineConfig())  # no held-out evaluation
    check_held_out_size(4, EngineConfig())


def test_a_new_run_regenerates_the_embedded_data_and_model(tmp_path) -> None:
    """The generated data and the untrained embedded model were written once per run folder: a new
    ``--overwrite`` run with other sizes or another seed silently trained on the old ones. A resumed run keeps
    the ones it started from."""
    from drivetrain_roles.jobs.assets import resolve_data_files, resolve_model_path
    from drivetrain_roles.sft.config import DataConfig
    from safetensors.torch import load_file

    for size, resume, lines in ((16, False, 16), (24, False, 24), (32, True, 24)):
        config = DataConfig(generated_train_size=size, generated_val_size=4)
        (train,), _ = resolve_data_files(config, tmp_path, 0, resume=resume)
        assert len(Path(train).read_text().splitlines()) == lines  # a resumed run keeps what it started from
    weights = []
    for seed in (0, 1, 0):
        model_dir = Path(resolve_model_path("builtin:arithmetic", tmp_path, seed))
        weights.append(load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"])
    assert not torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])
