"""``drivetrain dpo`` / ``rm`` ``--resume``: a resumed DPO run reproduces the uninterrupted one bit-exactly (with
the warm start it finished and the reference of the starting model), and a resume that cannot be one is one
clear error naming the fix."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_engine_core.backend import CheckpointError
from drivetrain_roles.dpo.config import load_config
from drivetrain_roles.dpo.trainer import DPOTrainer
from drivetrain_roles.runtime.tracking import read_records
from safetensors.torch import load_file

STEPS = [
    "data.generated_train_size=64",
    "data.generated_val_size=16",
    "trainer.batch_size=8",
    "trainer.eval_samples=8",
    "trainer.progress_bar=false",
    "warm_start.sft_steps=2",
    "warm_start.batch_size=8",
    "trainer.total_steps=4",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "checkpoint.max_ckpt_to_keep=2",
]


def run_dpo(output_dir, *overrides, resume=False):
    return DPOTrainer(load_config(overrides=[*STEPS, *overrides]), output_dir, resume=resume).run()


def test_a_resumed_dpo_run_reproduces_the_uninterrupted_one_exactly(tmp_path) -> None:
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = run_dpo(full_dir)
    # The run "crashed" after its step-2 checkpoint: drop what came later and resume.
    shutil.copytree(full_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "global_step_4")
    (resumed_dir / "checkpoints" / "latest").write_text("global_step_2")
    warm_summary = resumed_dir / "warm_start" / "summary.json"
    warm_written = warm_summary.stat().st_mtime_ns

    resumed = run_dpo(resumed_dir, resume=True)

    assert resumed.start_step == 2
    assert resumed.train_losses == full.train_losses[2:]  # bit-exact, not approximately
    # The whole run's: steps 0 and 2 (before the crash) read back from metrics.jsonl, then step 4.
    assert resumed.evaluations == full.evaluations
    assert [e["step"] for e in resumed.evaluations] == [0, 2, 4]
    assert resumed.warm_start == full.warm_start and warm_summary.stat().st_mtime_ns == warm_written
    records = read_records(resumed_dir / "metrics.jsonl")
    assert [r["train/loss"] for r in records if "train/loss" in r] == full.train_losses
    full_weights = load_file(full_dir / "final_model" / "model.safetensors")
    resumed_weights = load_file(resumed_dir / "final_model" / "model.safetensors")
    assert full_weights.keys() == resumed_weights.keys()
    assert all(full_weights[k].equal(resumed_weights[k]) for k in full_weights)
    assert json.loads((resumed_dir / "summary.json").read_text())["start_step"] == 2
    with pytest.raises(CheckpointError, match=r"trained with trainer.batch_size=8, this run has 16"):
        run_dpo(resumed_dir, "trainer.batch_size=16", resume=True)


def test_resume_without_a_checkpoint_is_one_error_naming_the_fix(tmp_path, monkeypatch) -> None:
    runner = CliRunner()
    empty = runner.invoke(drivetrain_cli, ["dpo", "--resume", "--output-dir", str(tmp_path / "empty")])
    assert empty.exit_code == 1 and "Traceback" not in empty.output
    assert "holds no complete checkpoint, so there is nothing to continue. Drop --resume" in empty.output
    monkeypatch.chdir(tmp_path)
    newest = runner.invoke(drivetrain_cli, ["rm", "--resume"])
    assert newest.exit_code == 2 and "Traceback" not in newest.output
    assert "--resume found no run with a checkpoint under" in newest.output
    assert "rm-*; pass --output-dir DIR of the run to continue" in newest.output
    both = runner.invoke(drivetrain_cli, ["dpo", "--resume", "--overwrite"])
    assert both.exit_code == 2 and "--overwrite deletes its checkpoints: pass one" in both.output


def test_a_refused_rm_resume_writes_nothing_and_a_resumed_rm_run_is_exact(tmp_path, folder_state) -> None:
    """A refused ``drivetrain rm --resume`` (another seed, another model) had already rebuilt
    ``<run>/initial_model`` (linked to the refused model's weights: the start its engine loads) and rewritten the
    warm start's SFT rows, and one with another model but the warm start it reused went on training the run's
    model; now each is one error and the folder is as it was, entry for entry (moved whole: the start's links
    into the run folder are relative), and a resume with the run's model and seed reproduces the uninterrupted
    run exactly."""
    from drivetrain_engine_core.testing import make_tiny_model_dir
    from drivetrain_roles.rm.config import load_config as load_rm_config
    from drivetrain_roles.rm.trainer import RMTrainer
    from drivetrain_roles.sft.config import load_config as load_sft_config
    from drivetrain_roles.sft.warm_start import run_warm_start

    steps = [*STEPS[:5], "warm_start.sft_steps=2", "warm_start.batch_size=8"]
    steps += ["trainer.total_steps=2", "trainer.save_every=1", "checkpoint.max_ckpt_to_keep=2"]
    full_dir, run = tmp_path / "full", tmp_path / "run"
    full = RMTrainer(load_rm_config(overrides=steps), full_dir).run()
    # The run "crashed" after its step-1 checkpoint.
    shutil.copytree(full_dir, run, symlinks=True)
    shutil.rmtree(run / "checkpoints" / "global_step_2")
    (run / "checkpoints" / "latest").write_text("global_step_1")
    before = folder_state(run)
    other = make_tiny_model_dir(tmp_path / "other", hidden_size=48)
    seed = "trained with trainer.seed=0, this run has 7; resume with the same value or start a new"
    run_start = (
        f"started from model.path=builtin:arithmetic after a warm start of 2 SFT steps ({run / 'config.yaml'}), "
        "this --resume from"
    )
    refusals = {
        ("trainer.seed=7",): seed,
        (f"model.path={other}",): f"{run_start} model.path={other} after a warm start of 2 SFT steps;",
        (f"model.path={other}", "warm_start.sft_steps=0"): f"{run_start} model.path={other} without a",
    }
    for overrides, message in refusals.items():
        refused = CliRunner().invoke(drivetrain_cli, ["rm", "--resume", "--output-dir", str(run), *overrides])
        assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
        assert message in refused.output
        assert folder_state(run) == before, overrides
    # The warm start's own record, for a run folder without config.yaml (and grpo's warm start).
    warm = load_sft_config(overrides=[f"model.path={other}"])
    trained_from = (
        f"the warm start in {run / 'warm_start'} was trained from model.path=builtin:arithmetic, this"
    )
    with pytest.raises(CheckpointError, match=re.escape(trained_from)):
        run_warm_start(warm, run, reuse=True, batch_size_setting="warm_start.batch_size")
    assert folder_state(run) == before

    resumed = RMTrainer(load_rm_config(overrides=steps), run, resume=True).run()
    assert resumed.start_step == 1
    assert resumed.train_losses == full.train_losses[1:]  # bit-exact
    assert resumed.evaluations == full.evaluations


def test_a_dpo_resume_from_another_start_is_refused_and_writes_nothing(tmp_path, folder_state) -> None:
    """``drivetrain dpo --resume`` of a run without a warm start, with another model of the same shape, went on
    from the checkpoint with the new model's reference log-probs (one run of two models); now it is one error
    naming the run's start and the asked one, like a warm start asked where the run had none, and the folder
    is as it was. The run's own model, under another spelling of its path, still resumes."""
    from drivetrain_engine_core.testing import make_tiny_model_dir

    model, other = make_tiny_model_dir(tmp_path / "model"), make_tiny_model_dir(tmp_path / "other", seed=1)
    steps = [*STEPS[:5], "warm_start.sft_steps=0", "trainer.total_steps=1", "trainer.save_every=1"]
    run = tmp_path / "run"
    DPOTrainer(load_config(overrides=[f"model.path={model}", *steps]), run).run()
    before = folder_state(run)
    run_start = (
        f"started from model.path={model} without a warm start ({run / 'config.yaml'}), this --resume from"
    )
    refusals = {
        (f"model.path={other}",): f"{run_start} model.path={other} without a warm start;",
        ("warm_start.sft_steps=2",): f"{run_start} model.path={model} after a warm start of 2 SFT steps;",
    }
    fix = f"Resume with model.path={model} warm_start.sft_steps=0, or start a new run without --resume."
    for overrides, message in refusals.items():
        refused = CliRunner().invoke(
            drivetrain_cli, ["dpo", "--resume", "--output-dir", str(run), *overrides]
        )
        assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
        assert message in refused.output and fix in refused.output, refused.output
        assert folder_state(run) == before, overrides

    (tmp_path / "link").symlink_to(model)
    resumed = CliRunner().invoke(
        drivetrain_cli, ["dpo", "--resume", "--output-dir", str(run), f"model.path={tmp_path / 'link'}"]
    )
    assert resumed.exit_code == 0, resumed.output
