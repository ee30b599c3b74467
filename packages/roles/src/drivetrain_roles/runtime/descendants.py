"""A launch that leaves nothing behind: every process it started is gone when the launcher returns.

Ranks start helper processes of their own (megatron's asynchronous checkpoint writer, data-loader workers);
when a rank exits or dies, such a helper is orphaned and keeps the rank's stdout/stderr open, so whoever reads
the launcher's output waits forever. :func:`owning_descendants` (the ``drivetrain sft --nproc`` launcher) makes
the launcher a child subreaper on Linux, so orphans of its descendants are re-parented to it instead of to
init, whatever sessions or process groups the ranks made (torch's elastic launcher starts each rank in a new
session); when the launch ends, every remaining descendant is killed and reaped (psutil lists them).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

import psutil

_PR_SET_CHILD_SUBREAPER = 36
REAP_TIMEOUT_S = 5.0
"""How long killed descendants get to disappear before the launcher returns anyway."""


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


def _become_subreaper() -> None:
    """Make orphaned descendants re-parent to this process (Linux ``PR_SET_CHILD_SUBREAPER``; else no-op)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


__all__ = ["REAP_TIMEOUT_S", "kill_descendants", "owning_descendants"]
