"""How a spawned rank's failure reaches the user: one line from the launcher, not every rank's traceback.

Each rank writes what went wrong to a file of a per-launch directory (:data:`ERROR_DIR_ENV`) instead of its
console: a user error as its one-line message, a crash (any other exception) as a short summary, with the
full traceback in the run folder (:data:`LOG_DIR_ENV`, ``<run>/logs/rank<R>.log``). The launcher prints one
report: a user error first (every rank agrees on it, so the lowest rank's), else a rank killed from outside
(:data:`KILLED_FROM_OUTSIDE`: ``kill -9``, the out-of-memory killer, a scheduler), else the crash written first
(the rank that failed, not a peer that then lost its connection to it), else the exit status of the first
failed rank.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

ERROR_DIR_ENV = "DRIVETRAIN_ERROR_DIR"
"""Set by the launcher: where each rank writes its one-line report instead of printing it."""
LOG_DIR_ENV = "DRIVETRAIN_LOG_DIR"
"""Set by the launcher: the run folder's ``logs/``, where a crashed rank writes its full traceback."""
_USER_ERROR = "rank{:05d}.txt"
_CRASH = "crash-rank{:05d}.txt"
_MESSAGE_CHARS = 300
KILLED_FROM_OUTSIDE = frozenset({"SIGKILL", "SIGHUP", "SIGQUIT"})
"""Signals a rank never sends itself, nor dies of when a peer fails (that is a crash, or SIGABRT/SIGSEGV): a
rank ended by one was killed from outside, and its peers' lost connections are the consequence, not the cause.
SIGTERM is not one: torch's agent stops the surviving ranks with it, and lists them among the failures."""


def launch_rank() -> int:
    """This process's rank as its launcher numbered it (``RANK``); 0 when no launcher started it."""
    return int(os.environ.get("RANK", "0"))


def report_rank_error(message: str) -> None:
    """Hand a rank's one-line user error to the launcher (or print it when this rank was not spawned by it)."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory is None:
        click.echo(message, err=True)
        return
    Path(directory, _USER_ERROR.format(launch_rank())).write_text(message)


def report_rank_crash(command: str, error: BaseException) -> bool:
    """Write the traceback of ``error`` (being handled) to ``<run>/logs/rank<R>.log`` and hand the launcher a
    summary naming the rank, the exception, where it was raised and that file.

    Returns:
        False when this rank was not spawned by drivetrain's launcher (an outer torchrun): the caller lets the
        exception print as usual.
    """
    directory, logs = os.environ.get(ERROR_DIR_ENV), os.environ.get(LOG_DIR_ENV)
    if directory is None or logs is None:
        return False
    rank = launch_rank()
    log = Path(logs, f"rank{rank}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(traceback.format_exc())
    Path(directory, _CRASH.format(rank)).write_text(
        f"drivetrain {command}: rank {rank} crashed with {_describe(error)}; full traceback: {log}"
    )
    return True


def _describe(error: BaseException) -> str:
    """``RuntimeError: message (file.py:12 in function)``, the message on one line and cut short."""
    message = " ".join(str(error).split())
    if len(message) > _MESSAGE_CHARS:
        message = message[: _MESSAGE_CHARS - 3] + "..."
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(error).__name__}: {message}{where}" if message else f"{type(error).__name__}{where}"


def failure_report(directory: Path, command: str, failures: Mapping[int, Any], node: str = "") -> str:
    """The one line the launcher prints for a failed launch (see the module docstring for the order).

    NOTE: a rank killed outright leaves no report, and its peers crash a moment later on their lost connection
    ("Connection closed by peer"): that crash was reported as the cause ("rank 0 crashed") and the killed rank
    and the signal were never named.

    Args:
        directory: the per-launch report directory.
        command: the command's name, for the lines naming a rank's exit status.
        failures: torch's ``ChildFailedError.failures``: rank -> failure with ``exitcode`` and ``signal_name()``.
        node: which node this launcher is (`` on node 1 (host)``), for a launch over several; empty on one.
    """
    user_errors = sorted(directory.glob(_USER_ERROR.replace("{:05d}", "*")))
    if user_errors:
        return user_errors[0].read_text()
    killed = [r for r in sorted(failures) if _signal(failures[r]) in KILLED_FROM_OUTSIDE]
    if killed:
        signal_name = _signal(failures[killed[0]])
        return (
            f"drivetrain {command}: rank {killed[0]}{node} was killed by {signal_name}, from outside the run (kill, "
            "the out-of-memory killer or a job scheduler: see the system log, e.g. `dmesg`); the other ranks were "
            "stopped."
        )
    crashes = sorted(
        directory.glob(_CRASH.replace("{:05d}", "*")), key=lambda p: (p.stat().st_mtime_ns, p.name)
    )
    if crashes:
        return crashes[0].read_text()
    rank = min(failures)
    failure = failures[rank]
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return (
        f"drivetrain {command}: rank {rank}{node} ended with {how} before it could report why (see the system "
        "log, e.g. `dmesg`)."
    )


def _signal(failure: Any) -> str | None:
    """The name of the signal that ended a failed rank, or None when it exited."""
    return str(failure.signal_name()) if failure.exitcode < 0 else None
