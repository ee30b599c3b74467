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
    """Within the block, adopt orphaned descendants (Linux); on leaving it, kill every descendant it started.

    Processes this process ran before the block (a library's helper, e.g. megatron's checkpoint-writer manager
    in a test process that also launches ranks) are left alone: only those that were not descendants when the
    block began are killed.
    """
    before = {process.pid for process in psutil.Process().children(recursive=True)}
    _become_subreaper()
    try:
        yield
    finally:
        kill_descendants(keep=before)


def kill_descendants(keep: frozenset[int] | set[int] = frozenset()) -> None:
    """SIGKILL every descendant of this process except the pids in ``keep``, and wait (bounded) until they are
    gone."""
    descendants = [p for p in psutil.Process().children(recursive=True) if p.pid not in keep]
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
