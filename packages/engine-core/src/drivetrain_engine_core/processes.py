"""Launches that leave nothing behind: every process a launch started is gone when the launcher returns.

Libraries start helper processes of their own inside a rank (megatron's asynchronous checkpoint writer,
data-loader workers). When a rank exits or dies, such a helper is orphaned: it keeps running and keeps the
rank's stdout/stderr open, so whoever reads the launcher's output waits forever. Two mechanisms remove them:

* :func:`owning_descendants` (the ``drivetrain sft --nproc`` launcher): on Linux the launcher becomes a child
  subreaper, so orphans of its descendants are re-parented to it instead of to init, whatever sessions or
  process groups the ranks made (torch's elastic launcher starts each rank in a new session); when the launch
  ends, every remaining descendant is killed and reaped (psutil lists them).
* :func:`kill_process_group` (the test launcher, whose ranks lead their own process group): kills a rank's
  whole group at once, without making the test process a subreaper for the rest of the session.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
REAP_TIMEOUT_S = 5.0
"""How long killed descendants get to disappear before the launcher returns anyway."""


def kill_process_group(leader_pid: int) -> None:
    """SIGKILL every process left in the group led by ``leader_pid`` (no-op when none is left)."""
    if not hasattr(os, "killpg"):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is empty: all exited
        os.killpg(leader_pid, signal.SIGKILL)


@contextlib.contextmanager
def owning_descendants() -> Iterator[None]:
    """Within the block, adopt orphaned descendants (Linux); on leaving it, kill every descendant left.

    Only processes started inside the block should be alive below this process when it ends; anything else
    this process started earlier and still runs is killed too, so call it around a launch in a CLI process.
    """
    _become_subreaper()
    try:
        yield
    finally:
        kill_descendants()


def kill_descendants() -> None:
    """SIGKILL every descendant of this process and wait (bounded) until they are gone."""
    descendants = psutil.Process().children(recursive=True)
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(descendants, timeout=REAP_TIMEOUT_S)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; else no-op).

    A launched rank whose launcher is killed outright (SIGKILL, an OOM kill) gets no chance to be cleaned up
    and would otherwise wait forever on a queue nobody reads.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _become_subreaper() -> None:
    """Make orphaned descendants re-parent to this process (Linux ``PR_SET_CHILD_SUBREAPER``; else no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
