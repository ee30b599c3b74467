"""``model.path`` as a Hub repository id (``org/name``), as TRL and verl users write it.

The Hugging Face cache here is a real one on disk (``models--org--name/refs/main`` and ``snapshots/<sha>/``, the
layout ``hf download`` writes), holding the embedded model; the Hub is never asked (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
from click.testing import CliRunner
from drivetrain_engine_core._cli import main as drivetrain_cli
from drivetrain_roles.jobs.default_assets import write_model_dir
from drivetrain_roles.jobs.metrics import read_records

REPO = "acme/arithmetic-tiny"
REVISION = "0123456789abcdef0123456789abcdef01234567"
RUN = [
    "data.generated_train_size=64",
    "data.generated_val_size=8",
    "trainer.batch_size=16",
    "trainer.eval_samples=8",
    "trainer.eval_every=0",
    "trainer.max_new_tokens=4",
    "trainer.progress_bar=false",
    "trainer.total_steps=3",
    "trainer.save_every=0",
]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding ``REPO`` at ``main``; returns the snapshot directory."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    snapshot = repo / "snapshots" / REVISION
    write_model_dir(snapshot, seed=0)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snapshot


def losses(run_dir):
    return [r["train/loss"] for r in read_records(run_dir / "metrics.jsonl") if "train/loss" in r]


def test_a_hub_id_trains_the_cached_snapshot_exactly_as_its_directory(hub_cache, tmp_path) -> None:
    runs = {"hub": REPO, "directory": str(hub_cache)}
    for name, path in runs.items():
        result = CliRunner().invoke(
            drivetrain_cli, ["sft", "--output-dir", str(tmp_path / name), f"model.path={path}", *RUN]
        )
        assert result.exit_code == 0, result.output
    assert len(losses(tmp_path / "hub")) == 3
    assert losses(tmp_path / "hub") == losses(tmp_path / "directory")


def test_a_hub_id_this_machine_cannot_get_is_one_line_naming_the_fix(hub_cache, tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        drivetrain_cli, ["sft", "--output-dir", str(run_dir), "model.path=acme/not-downloaded", *RUN]
    )
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith(
        "Error: model.path=acme/not-downloaded is not a local directory, and the Hugging Face Hub repository of "
        "that name is not in this machine's cache and could not be fetched (LocalEntryNotFoundError: "
    )
    assert line.endswith(
        "Fetch it where the Hub is reachable (`hf download acme/not-downloaded`, into the cache HF_HOME points "
        "at), or set model.path to a local model directory."
    )
    assert not run_dir.exists()


def test_a_run_from_a_hub_id_resumes_from_its_snapshot_path_and_back_but_not_from_a_newer_revision(
    hub_cache, tmp_path
) -> None:
    """The start check (jobs.resume_start) compared the two spellings as text: a run started from ``org/name``
    was refused a resume from the snapshot directory that id stands for, and the reverse."""
    run_dir = tmp_path / "run"

    def sft(*args: str):
        return CliRunner().invoke(drivetrain_cli, ["sft", "--output-dir", str(run_dir), *RUN, *args])

    assert sft(f"model.path={hub_cache}").exit_code == 0
    for path, steps in ((REPO, 4), (hub_cache, 5)):
        resumed = sft("--resume", f"model.path={path}", f"trainer.total_steps={steps}")
        assert resumed.exit_code == 0, resumed.output
        assert len(losses(run_dir)) == steps

    newer = "fedcba9876543210fedcba9876543210fedcba98"
    write_model_dir(hub_cache.parent / newer, seed=1)
    (hub_cache.parent.parent / "refs" / "main").write_text(newer)
    refused = sft("--resume", f"model.path={REPO}", "trainer.total_steps=6")
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert f"this --resume from model.path={REPO};" in refused.output
    assert len(losses(run_dir)) == 5


def test_a_run_from_a_hub_id_resumes_only_from_the_snapshot_it_started_from(hub_cache, tmp_path) -> None:
    """Every command fetches a Hub id before it runs, so a resume after the repository moved on loaded the newer
    revision (and GRPO's, PPO's, DPO's reference from it) without a word: the run records the snapshot it
    started from, and a resume from the id is refused once ``main`` points elsewhere; the recorded snapshot's
    path, which the refusal names, resumes."""
    run_dir = tmp_path / "run"

    def sft(*args: str):
        return CliRunner().invoke(drivetrain_cli, ["sft", "--output-dir", str(run_dir), *RUN, *args])

    assert sft(f"model.path={REPO}").exit_code == 0
    assert json.loads((run_dir / "start_snapshot.json").read_text()) == {
        "model.path": REPO,
        "snapshot": str(hub_cache),
    }
    assert sft("--resume", f"model.path={REPO}", "trainer.total_steps=4").exit_code == 0

    newer = "fedcba9876543210fedcba9876543210fedcba98"
    write_model_dir(hub_cache.parent / newer, seed=1)
    (hub_cache.parent.parent / "refs" / "main").write_text(newer)
    refused = sft("--resume", f"model.path={REPO}", "trainer.total_steps=5")
    assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
    assert (
        f"started from model.path={REPO} ({run_dir / 'config.yaml'}), the Hugging Face snapshot {hub_cache} "
        f"({run_dir / 'start_snapshot.json'}), this --resume from model.path={REPO}, now the snapshot "
        f"{hub_cache.parent / newer} (a newer revision);"
    ) in " ".join(refused.output.split())
    assert f"Resume with model.path={hub_cache}, or start a new run without --resume." in " ".join(
        refused.output.split()
    )
    assert len(losses(run_dir)) == 4
    resumed = sft("--resume", f"model.path={hub_cache}", "trainer.total_steps=5")
    assert resumed.exit_code == 0, resumed.output
    assert len(losses(run_dir)) == 5
