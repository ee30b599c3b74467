"""How a drivetrain process ends: as the interpreter would, minus its teardown.

torch's gloo backend runs collectives on threads of its own, and a group's threads live as long as the group.
Libraries keep groups referenced to the end (DTensor's caches keep FSDP2's device meshes, which hold their
groups; megatron-core keeps its groups in module globals), so ``destroy_process_group`` cannot join them.
A gloo thread that releases a finished collective's tensor while the interpreter tears itself down must take
the GIL to drop the tensor's Python object; the interpreter ends such a thread in the middle of a C++
destructor, and the process aborts with "terminate called without an active exception" (SIGABRT) after its
work is done and saved. The launcher then reports the rank as failed (about 1 run in 10 of a 2-rank CPU run;
pytorch/pytorch#179291 tried to fix it in torch and was abandoned).

:func:`exit_process` ends the process the way Python does up to that teardown (thread pools stopped and
non-daemon threads joined, exit handlers run, standard streams flushed) and then leaves at once, so no thread
is ever asked to stop while it holds a half-released tensor. The ``drivetrain`` command and every rank it launches end through
:func:`run_then_exit`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run ``main`` and end the process with its exit status through :func:`exit_process`.

    ``SystemExit`` gives the status (as with ``python``: ``None`` is 0, a string is printed and gives 1); any
    other exception is printed with its traceback, as Python prints an uncaught one, and gives 1.
    """
    try:
        main()
        status: object = 0
    except SystemExit as e:
        status = e.code
    except BaseException:  # reported as Python reports an uncaught exception, then the same exit
        traceback.print_exc()
        status = 1
    exit_process(status)


def exit_process(status: object = 0) -> NoReturn:
    """End the process now: stop thread pools and join non-daemon threads, run the exit handlers, flush
    stdout/stderr, leave.

    Everything Python does before it tears down its objects happens, in Python's order; the teardown itself
    is skipped (see the module docstring for why).
    """
    code = _exit_code(status)
    # What the interpreter runs first at exit: the threading exit hooks (they stop idle thread-pool workers,
    # which would otherwise wait for work forever), then a join of every non-daemon thread.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing left to say on it
            stream.flush()
    os._exit(code)


def _exit_code(status: object) -> int:
    """The code Python's ``sys.exit(status)`` would give: 0 for ``None``, the int itself, else 1 (printed)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1
