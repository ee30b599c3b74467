"""Ctrl-C during a run's steps: the first one stops it after the current step with a checkpoint, a second at once.

A run interrupted between checkpoints would lose every step since its last save (up to
``trainer.save_every - 1``). The step loop's SIGINT handler (:class:`StopRequests`) therefore only notes the
first Ctrl-C; at the next step boundary the ranks agree (one all-reduce of the flag, so every rank stops after
the same step, also one that never saw the signal), save a checkpoint and raise :class:`RunInterrupted`
naming it. A second Ctrl-C raises ``KeyboardInterrupt`` where the run is. Outside the step loop (set-up, the
final model) there is nothing to save and Ctrl-C stops the run at once.

Under ``--nproc`` the terminal's Ctrl-C reaches the launcher only (torch starts each rank in a session of its
own). Each rank in its step loop leaves a file with its process id in the launch's report directory
(:data:`~.rank_failures.ERROR_DIR_ENV`); the launcher's first Ctrl-C is sent on to one of them, the lowest
(:func:`forwarding_ctrl_c`: the step boundary's all-reduce tells the others), or stops every rank at once when
none is in its loop. Rank 0, once saved, hands its message to the launcher, and every rank ends with status 0
(a rank that ended with another makes torch's agent stop the others, perhaps mid-save); the launcher prints
the message and exits 130. Under ``trainer.placement=ray`` the driver does the same through a small Ray task on
each rank's node (:mod:`.ray_ctrl_c`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import click
from drivetrain_engine_core.job import INTERRUPTED

from .rank_failures import ERROR_DIR_ENV, launch_rank

_READY = "stop-rank{:05d}.pid"
_REPORT = "interrupted.txt"


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C after ``step`` steps, with a checkpoint of that step (every rank raises it).

    A ``KeyboardInterrupt``, so that it passes the handlers a failure would meet and ends the process with
    status 130 wherever the run is embedded.

    Args:
        message: what happened and how to continue, in one line.
        step: the steps done.
        checkpoint: the checkpoint of that step.
    """

    def __init__(self, message: str, *, step: int, checkpoint: Path) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class StopRequests:
    """This rank's Ctrl-C while its step loop runs: the first is noted, the second interrupts at once.

    Args:
        command: the command's name, for the line the first Ctrl-C prints.
    """

    def __init__(self, command: str) -> None:
        self.command = command
        self.requested = False

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Handle SIGINT inside the block (in the main thread only: elsewhere Python cannot, and Ctrl-C
        interrupts as before) and tell the launcher that this rank takes a stop request."""
        with sigint_taken_by(self._handle) as taken:
            ready = _announce_ready() if taken else None
            try:
                yield
            finally:
                if ready is not None:
                    ready.unlink(missing_ok=True)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if os.environ.get(ERROR_DIR_ENV) is None and launch_rank() == 0:  # spawned: the launcher says it
            _say(
                f"drivetrain {self.command}: Ctrl-C: the run stops after the current step and saves a checkpoint; "
                "Ctrl-C again stops it at once."
            )


def hand_over(command: str, interrupted: RunInterrupted) -> int:
    """Report an interrupted run (rank 0: printed, or handed to drivetrain's launcher); returns the exit status
    this rank ends with (0 when the launcher reports it, 130 otherwise)."""
    directory = os.environ.get(ERROR_DIR_ENV)
    message = f"drivetrain {command}: {interrupted}"
    if directory is None:
        if launch_rank() == 0:
            click.echo(message, err=True)
        return INTERRUPTED
    if launch_rank() == 0:
        Path(directory, _REPORT).write_text(message)
    return 0


@contextlib.contextmanager
def forwarding_ctrl_c(directory: Path, command: str) -> Iterator[None]:
    """The launcher's Ctrl-C while its ranks run: the first is sent on to the lowest rank in its step loop
    (the ranks agree on it at the next step boundary), or stops every rank at once when none is in its loop;
    a second stops every rank at once."""
    forwarded = False

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal forwarded
        if forwarded or not send_ctrl_c(str(directory)):
            raise KeyboardInterrupt
        forwarded = True
        say_forwarded(command)

    with sigint_taken_by(handle):
        yield


@contextlib.contextmanager
def sigint_taken_by(handler: Callable[[int, FrameType | None], None]) -> Iterator[bool]:
    """Inside the block, SIGINT runs ``handler`` and is not blocked in this thread; yields whether it does (in
    the main thread only: elsewhere Python cannot handle signals, and Ctrl-C interrupts as before).

    A process may start with SIGINT blocked, and children inherit the mask: Ray starts its workers so, and so
    may a job scheduler's or CI's supervisor. A blocked Ctrl-C stays pending, and the rank or launcher never
    stops; the block's own handler decides what it means instead.
    """
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.signal(signal.SIGINT, handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield True
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)


def send_ctrl_c(directory: str) -> bool:
    """Send Ctrl-C (SIGINT) to the lowest rank that announced in ``directory`` that it is in its step loop;
    ``False`` when none is there."""
    ready = sorted(Path(directory).glob(_READY.replace("{:05d}", "*")))
    if not ready:
        return False
    # Gone since the glob, or the rank itself: it just left its loop, and the run is ending anyway.
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        os.kill(int(ready[0].read_text()), signal.SIGINT)
    return True


def say_forwarded(command: str) -> None:
    """The launcher's line for a Ctrl-C sent on to the ranks."""
    _say(
        f"drivetrain {command}: Ctrl-C: every rank stops after the current step and saves a checkpoint; "
        "Ctrl-C again stops them at once."
    )


def interrupt_report(directory: Path) -> str | None:
    """The message a rank handed over after saving an interrupted run, if one did."""
    path = directory / _REPORT
    return path.read_text() if path.exists() else None


def _announce_ready() -> Path | None:
    """Leave this rank's process id for drivetrain's launcher (when it started this rank)."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory is None:
        return None
    path = Path(directory, _READY.format(launch_rank()))
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(str(os.getpid()))
    staged.replace(path)  # whole or absent: the launcher may read it at any moment
    return path


def _say(message: str) -> None:
    """One line on stderr from a signal handler: straight to the file descriptor, since the buffered stream
    may be in the middle of a write (the progress bar's) and refuses a reentrant one."""
    os.write(2, f"\n{message}\n".encode())


__all__ = [
    "RunInterrupted",
    "StopRequests",
    "forwarding_ctrl_c",
    "hand_over",
    "interrupt_report",
    "say_forwarded",
    "send_ctrl_c",
    "sigint_taken_by",
]
