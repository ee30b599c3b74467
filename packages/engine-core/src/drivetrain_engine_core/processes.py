"""Child processes that leave nothing behind: each launched rank leads its own process group.

Libraries start helper processes of their own inside a rank (megatron's asynchronous checkpoint writer,
data-loader workers). When a rank dies or is killed, such a helper is orphaned: it keeps running and keeps the
rank's stdout/stderr pipes open, so whoever reads the launcher's output waits forever. Starting each launch in
a new session and killing the whole process group when the launch ends removes every descendant at once
(POSIX; on other systems only the direct child is stopped).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

GRACE_S = 10.0
"""How long a launch may take to exit after it was asked to stop (Ctrl-C) before it is killed."""


def kill_process_group(leader_pid: int) -> None:
    """SIGKILL every process left in the group led by ``leader_pid`` (no-op when none is left)."""
    if not hasattr(os, "killpg"):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is empty: all exited
        os.killpg(leader_pid, signal.SIGKILL)


def run_process_group(command: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` in a new process group, wait for it, then kill whatever it left running.

    A Ctrl-C in this process is passed on to the whole group (as torchrun would receive it from a terminal),
    which then gets :data:`GRACE_S` to exit before it is killed.

    Returns:
        The command's exit code (negative: killed by that signal).
    """
    process = subprocess.Popen(
        list(command), env=dict(env) if env is not None else None, start_new_session=True
    )
    try:
        return process.wait()
    except KeyboardInterrupt:
        _interrupt(process)
        raise
    finally:
        kill_process_group(process.pid)
        process.wait()


def _interrupt(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGINT)
        process.wait(GRACE_S)
