"""A spawned rank's entry (``rank_main``): one-line user errors, and an end without the interpreter's teardown.

Regression: about 1 in 10 ``drivetrain sft --nproc 2`` runs (CI included) lost rank 1 after its work was saved,
to "terminate called without an active exception" from a gloo thread during that teardown (see core's
``process_exit``); the launcher then failed the whole run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from drivetrain_engine_core.testing.child_process import TEARDOWN_MARKER, TEARDOWN_PROBE, run_python

CHILD = TEARDOWN_PROBE + textwrap.dedent(
    """
    import sys

    import click
    from drivetrain_engine_core._config import ConfigError
    from drivetrain_roles.jobs.launch import rank_main

    @click.command()
    @click.option("--fail", is_flag=True)
    @click.option("--interrupt", is_flag=True)
    @click.option("--ready-file", default=None)
    def demo(fail, interrupt, ready_file):
        if ready_file:
            import pathlib, time
            pathlib.Path(ready_file).write_text("ready")
            time.sleep(120)
        if interrupt:
            raise KeyboardInterrupt
        if fail:
            raise ConfigError("trainer.batch_size=3 does not divide\\n  over 2 ranks")
        click.echo("rank work done")

    rank_main(demo, "demo", sys.argv[1:])
    """
)


def run_rank(*arguments: str) -> subprocess.CompletedProcess[str]:
    return run_python(CHILD, *arguments)


def test_a_rank_that_finished_ends_with_zero_and_without_the_teardown() -> None:
    result = run_rank()
    assert result.returncode == 0, result.stderr
    assert result.stdout == "rank work done\n"


def test_a_rank_user_error_is_one_line_and_exit_code_one() -> None:
    result = run_rank("--fail")
    assert result.returncode == 1
    assert result.stderr == "drivetrain demo: error: trainer.batch_size=3 does not divide over 2 ranks\n"
    assert TEARDOWN_MARKER not in result.stdout


def test_ctrl_c_ends_a_rank_quietly_with_130() -> None:
    result = run_rank("--interrupt")
    # click ends the ^C line with a newline; nothing else is said.
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "\n")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def test_a_rank_dies_with_its_launcher(tmp_path) -> None:
    """torch's launcher starts each rank in its own session: a launcher killed outright (kill -9, the OOM
    killer) left its ranks running, training and saving beside the --resume the user started next."""
    ready = tmp_path / "ready"
    launcher_code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        rank = subprocess.Popen([sys.executable, "-c", {CHILD!r}, "--ready-file", {str(ready)!r}],
                                start_new_session=True)
        print(rank.pid, flush=True)
        time.sleep(120)
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    rank_pid = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists() and _alive(rank_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank_pid)
    finally:
        if _alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
        launcher.kill()
