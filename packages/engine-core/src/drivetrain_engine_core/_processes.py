"""Rank processes that leave nothing behind: a rank dies with its launcher, a rank's group is killed whole.

Libraries start helper processes of their own inside a rank (megatron's asynchronous checkpoint writer,
data-loader workers). When a rank exits or dies, such a helper is orphaned: it keeps running and keeps the
rank's stdout/stderr open, so whoever reads the launcher's output waits forever.

* :func:`kill_process_group` (the test launcher, whose ranks lead their own process group): kills a rank's
  whole group at once, without making the test process a subreaper for the rest of the session.
* :func:`die_with_parent` (every launched rank): the kernel ends the rank when its launcher dies.

The ``drivetrain sft --nproc`` launcher also adopts and kills orphans of its ranks; that lives with the launcher
in drivetrain-roles (``drivetrain_roles.runtime.descendants``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def kill_process_group(leader_pid: int) -> None:
    """SIGKILL every process left in the group led by ``leader_pid`` (no-op when none is left)."""
    if not hasattr(os, "killpg"):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is empty: all exited
        os.killpg(leader_pid, signal.SIGKILL)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; else no-op).

    A launched rank whose launcher is killed outright (SIGKILL, an OOM kill) gets no chance to be cleaned up
    and would otherwise wait forever on a queue nobody reads.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


__all__ = ["die_with_parent", "kill_process_group"]
