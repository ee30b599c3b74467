"""``drivetrain grpo`` / ``ppo`` ``--resume`` from another start model of the same shape: the actor would resume
from the checkpoint while the KL reference (and ppo's critic start) came from the new model, one run of two
models; it is refused before anything loads or is written, and the run's own model still resumes."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_roles.jobs.default_assets import write_model_dir

FIRST = (
    "engine.micro_batch.micro_batch_size=4",
    "engine.micro_batch.max_tokens=null",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "algorithm.ppo_mini_batches=1",
    "algorithm.kl_loss_coef=0.05",
    "data.generated_train_size=8",
    "data.generated_val_size=0",
    "trainer.prompts_per_step=2",
    "trainer.total_steps=1",
    "trainer.save_every=1",
    "trainer.progress_bar=false",
)
"""One step of two prompts with a KL loss (a reference is built), saved: the smallest run a resume continues."""


@pytest.mark.parametrize("command", ["grpo", "ppo"])
def test_a_resume_from_another_model_of_the_same_shape_is_refused_and_writes_nothing(
    tmp_path, folder_state, command
) -> None:
    model, other = write_model_dir(tmp_path / "model", seed=3), write_model_dir(tmp_path / "other", seed=4)
    run = tmp_path / "run"
    extra = ["trainer.critic_warmup=0"] if command == "ppo" else []
    started = CliRunner().invoke(
        drivetrain_cli, [command, "--output-dir", str(run), f"model.path={model}", *FIRST, *extra]
    )
    assert started.exit_code == 0, started.output
    before = folder_state(run)

    refused = CliRunner().invoke(
        drivetrain_cli, [command, "--resume", "--output-dir", str(run), f"model.path={other}"]
    )

    assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
    expected = (
        f"the run in {run} started from model.path={model} ({run / 'config.yaml'}), this --resume from "
        f"model.path={other};"
    )
    assert expected in refused.output, refused.output
    fix = f"Resume with model.path={model}, or start a new run without --resume."
    assert fix in refused.output, refused.output
    assert folder_state(run) == before

    (tmp_path / "link").symlink_to(model)
    resumed = CliRunner().invoke(
        drivetrain_cli,
        [
            command,
            "--resume",
            "--output-dir",
            str(run),
            f"model.path={tmp_path / 'link'}",
            "trainer.total_steps=2",
        ],
    )
    assert resumed.exit_code == 0, resumed.output
    assert (run / "checkpoints" / "latest").read_text() == "global_step_2"
