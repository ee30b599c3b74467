"""Every spawned rank runs one module (``jobs.rank_entry``) that finds its command in the plugin registry, so a
third party's job command runs under ``--nproc`` as roles' own do.

Regression: the launcher spawned ``python -m drivetrain_roles.<command>.rank_main``, a module only roles' own
commands had; ``drivetrain my-sft --nproc 2`` from another distribution failed with "rank 0 ended with exit
code 1 before it could report why". (Roles' own commands under ``--nproc 2``: test_roles_sft,
test_roles_preference_commands.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from drivetrain_engine_core.job import complete_steps

DRIVETRAIN = Path(sys.executable).parent / "drivetrain"

COMMAND = """
from drivetrain_roles.jobs.command import job_command

my_sft = job_command(
    "my-sft",
    job="drivetrain_roles.sft.trainer:SFTTrainer",
    config="drivetrain_roles.sft.config:SFTConfig",
    help="SFT, registered by a distribution other than drivetrain-roles.",
)
"""

PLUGIN = """
from drivetrain_engine_core._hookspecs import hookimpl


@hookimpl
def register_commands(cli):
    from my_jobs.command import my_sft

    cli.add_command(my_sft)
"""


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process that sees the distribution ``my-jobs``: its package ``my_jobs`` and its
    metadata, declaring the plugin under core's entry-point group, on ``PYTHONPATH`` (so the ranks see it too)."""
    site = tmp_path_factory.mktemp("site")
    (site / "my_jobs").mkdir()
    (site / "my_jobs" / "__init__.py").write_text("")
    (site / "my_jobs" / "command.py").write_text(COMMAND)
    (site / "my_jobs" / "plugin.py").write_text(PLUGIN)
    metadata = site / "my_jobs-0.1.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: my-jobs\nVersion: 0.1.0\n")
    (metadata / "entry_points.txt").write_text("[drivetrain]\nmy_jobs = my_jobs.plugin\n")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.slow
def test_a_third_party_job_command_runs_under_nproc_2(third_party, tmp_path) -> None:
    run_dir = tmp_path / "run"
    command = [
        DRIVETRAIN, "my-sft", "--nproc", "2", "--output-dir", run_dir,
        "model.path=builtin:arithmetic", "trainer.total_steps=2", "trainer.save_every=2",
        "data.generated_train_size=32", "data.generated_val_size=4", "trainer.batch_size=8",
        "trainer.eval_samples=4", "trainer.eval_every=0", "trainer.max_new_tokens=2",
        "trainer.progress_bar=false",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=third_party)
    assert done.returncode == 0, done.stderr
    beats = [json.loads((run_dir / "heartbeat" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [b["step"] for b in beats] == [2, 2]  # both ranks trained both steps
    assert [step for step, _ in complete_steps(run_dir / "checkpoints")] == [2]
    assert json.loads((run_dir / "summary.json").read_text())["evaluations"][-1]["step"] == 2


def test_an_unknown_command_is_one_line_naming_the_registered_ones(third_party) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "drivetrain_roles.jobs.rank_entry", "my-sfft", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=third_party,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith(
        "drivetrain: error: no command 'my-sfft' is registered; the registered commands are "
    )
    assert done.stderr.count("\n") == 1
    listed = done.stderr.split("the registered commands are ")[1].split(". ")[0].split(", ")
    assert {"my-sft", "sft", "grpo", "ppo", "engines"} <= set(listed)  # a third party's among roles' own
