"""``drivetrain sft --nproc 2`` interrupted or crashed: one line, the right exit status, the rest in a file.

Regressions: Ctrl-C printed torch's "death signal" warning and, when it reached ranks still starting, a
``site`` traceback per rank (torch's launcher forwarded SIGINT to them); a crash printed every rank's traceback
and torch's failure table (123-181 lines) instead of naming the rank, the exception and the full log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from drivetrain_engine_core.job import complete_steps
from drivetrain_roles.jobs.rank_failures import failure_report
from drivetrain_roles.runtime.tracking import read_records

_WAIT_S = 120


@pytest.fixture
def start_sft(launches):
    """``start_sft(run_dir, *overrides, env=None)``: ``drivetrain sft --nproc 2`` of the tiny job in a session
    of its own (``launches.start``)."""

    def start(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        arguments = ["--output-dir", str(run_dir), *launches.tiny_sft, *overrides]
        return launches.start("sft", *arguments, nproc=2, env=env)

    return start


def _wait_for(condition, launcher: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the launch never got there"
        time.sleep(0.02)


def _ranks_started(launcher_pid: int) -> bool:
    """Whether the launcher has started a rank (not one of the helpers its imports run, such as ldconfig)."""
    for child in psutil.Process(launcher_pid).children():
        try:
            if "drivetrain_roles.jobs.rank_entry" in child.cmdline():
                return True
        except psutil.NoSuchProcess:
            continue
    return False


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_start_is_one_line_and_130(tmp_path, start_sft, launches) -> None:
    run_dir = tmp_path / "run"
    launcher = start_sft(run_dir, "trainer.total_steps=1000")
    _wait_for(lambda: _ranks_started(launcher.pid), launcher)  # their interpreters still import site packages
    os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    status, err = launches.finish(launcher)
    assert (status, err) == (130, "drivetrain sft: interrupted; every rank was stopped.\n")


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_train_stops_both_after_one_step_and_saves_it(
    tmp_path, start_sft, launches
) -> None:
    """Ctrl-C lost every step since the last save. The launcher hands it to rank 0 alone: rank 1 learns of it
    from the all-reduce at the step boundary, so both stop after the same step and save it together."""
    run_dir = tmp_path / "run"
    launcher = start_sft(run_dir, "trainer.total_steps=1000")
    _wait_for(lambda: len(list((run_dir / "heartbeat").glob("rank*.json"))) == 2, launcher)
    os.killpg(launcher.pid, signal.SIGINT)
    status, err = launches.finish(launcher)
    steps = [r["step"] for r in read_records(run_dir / "metrics.jsonl") if "train/loss" in r]
    done = steps[-1]
    saved = run_dir / "checkpoints" / f"global_step_{done}"
    assert (status, err) == (
        130,
        "\ndrivetrain sft: Ctrl-C: every rank stops after the current step and saves a checkpoint; Ctrl-C again "
        f"stops them at once.\ndrivetrain sft: interrupted after step {done} of 1000; saved checkpoint {saved}. "
        f"Continue with: drivetrain sft --resume --output-dir {run_dir}\n",
    )
    assert steps == list(range(1, done + 1)) and [s for s, _ in complete_steps(saved.parent)] == [done]
    beats = [json.loads((run_dir / "heartbeat" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(b["step"], b["phase"]) for b in beats] == [(done, "save")] * 2


def _rank_process(launcher_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher_pid).children():
        if "drivetrain_roles.jobs.rank_entry" in child.cmdline() and child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no rank {rank} under the launcher")


def _beat(run_dir: Path, rank: int) -> tuple[int, str]:
    try:
        beat = json.loads((run_dir / "heartbeat" / f"rank{rank}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return (-1, "")
    return beat["step"], beat["phase"]


@pytest.mark.slow
def test_a_rank_killed_outright_is_named_with_the_signal(tmp_path, start_sft, launches) -> None:
    """Rank 1 killed by SIGKILL was reported as "rank 0 crashed with RuntimeError: ... Connection closed by
    peer" (the survivor's lost connection), never naming rank 1 or the signal."""
    run_dir = tmp_path / "run"
    launcher = start_sft(run_dir, "trainer.total_steps=1000")
    _wait_for(lambda: min(_beat(run_dir, r)[0] for r in (0, 1)) >= 1, launcher)
    _rank_process(launcher.pid, 1).kill()
    status, err = launches.finish(launcher)
    assert (status, err) == (
        1,
        "drivetrain sft: rank 1 was killed by SIGKILL, from outside the run (kill, the out-of-memory killer or a "
        "job scheduler: see the system log, e.g. `dmesg`); the other ranks were stopped.\n",
    )


@pytest.mark.slow
def test_ctrl_c_in_the_last_step_is_an_interrupt_not_a_finished_run(tmp_path, start_sft, launches) -> None:
    """A Ctrl-C during step 8 of 8 was announced as "every rank stops after the current step and saves" and the
    run then finished with status 0 (final model, summary): an interrupt reported as success."""
    run_dir = tmp_path / "run"
    launcher = start_sft(run_dir, "trainer.total_steps=8")
    _wait_for(
        lambda: _beat(run_dir, 0) == (8, "train"), launcher
    )  # after step 7's agreement: in the last step
    os.killpg(launcher.pid, signal.SIGINT)
    status, err = launches.finish(launcher)
    saved = run_dir / "checkpoints" / "global_step_8"
    assert (status, err.splitlines()[-1]) == (
        130,
        f"drivetrain sft: interrupted after step 8 of 8; saved checkpoint {saved}. Continue with: drivetrain sft "
        f"--resume --output-dir {run_dir}",
    )
    assert [s for s, _ in complete_steps(saved.parent)] == [8] and not (run_dir / "summary.json").exists()


SITECUSTOMIZE = """
import os
if os.environ.get("RANK") == "1":
    from drivetrain_roles.sft import trainer

    def run(self):
        raise RuntimeError("injected fault on purpose")

    trainer.SFTTrainer.run = run
"""


@pytest.mark.slow
def test_a_rank_crash_is_one_line_naming_the_rank_the_exception_and_the_log(
    tmp_path, start_sft, launches
) -> None:
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "inject")}
    run_dir = tmp_path / "run"
    status, err = launches.finish(start_sft(run_dir, "trainer.total_steps=2", env=env))
    log = run_dir / "logs" / "rank1.log"
    assert status == 1
    assert err == (
        "drivetrain sft: rank 1 crashed with RuntimeError: injected fault on purpose (sitecustomize.py:7 in "
        f"run); full traceback: {log}\n"
    )
    full = log.read_text()
    assert full.startswith("Traceback (most recent call last):") and "injected fault on purpose" in full


def _failure(exitcode: int, signal_name: str = "") -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, signal_name=lambda: signal_name)


def test_the_report_is_the_user_error_else_the_first_crash_else_the_exit_status(tmp_path) -> None:
    """A peer that lost its connection to the crashed rank crashes later: its report must not hide the cause."""
    failures = {0: _failure(1), 1: _failure(1)}
    (tmp_path / "crash-rank00001.txt").write_text("rank 1 crashed first")
    time.sleep(0.01)
    (tmp_path / "crash-rank00000.txt").write_text("rank 0 lost its peer")
    assert failure_report(tmp_path, "sft", failures) == "rank 1 crashed first"
    (tmp_path / "rank00001.txt").write_text("drivetrain sft: error: a user error")
    assert failure_report(tmp_path, "sft", failures) == "drivetrain sft: error: a user error"

    empty = tmp_path / "empty"
    empty.mkdir()
    killed = {
        0: _failure(-15, "SIGTERM"),
        3: _failure(-9, "SIGKILL"),
    }  # the agent stops the others by SIGTERM
    assert failure_report(tmp_path, "sft", killed, " on node 1 (b)").startswith(
        "drivetrain sft: error: a user"
    )
    assert failure_report(empty, "sft", killed, " on node 1 (b)").startswith(
        "drivetrain sft: rank 3 on node 1 (b) was killed by SIGKILL, from outside the run"
    )
    assert failure_report(empty, "sft", {1: _failure(-6, "SIGABRT")}).startswith(
        "drivetrain sft: rank 1 ended with signal SIGABRT before it could report why"
    )
