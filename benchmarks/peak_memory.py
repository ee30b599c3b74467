"""What the memory benchmarks share: a Linux process's resident set from ``/proc`` (now, and its peak since a
reset) and a measurement run in a fresh process.

``VmHWM`` is the kernel's high-water mark of a process's resident set; writing ``5`` to ``/proc/<pid>/clear_refs``
resets it to the current size, so a peak read after a stretch of work is that stretch's own. Both take any pid
of this user, so a benchmark can watch a server process beside its own (the product's meter of a stretch in its
own process is ``drivetrain_engine_core._usage``).
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
from collections.abc import Callable
from pathlib import Path
from typing import Any


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A ``VmHWM``/``VmRSS`` value of process ``pid``, in bytes (Linux ``/proc``; reported in KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}; this benchmark needs Linux.")


def reset_peak_rss(pid: int | str = "self") -> None:
    """Reset process ``pid``'s ``VmHWM`` to its current resident set size."""
    # NOTE: ru_maxrss would not do: it cannot be reset, and it survives exec, so a spawned child inherits its
    # parent's peak.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def run_in_fresh_process(target: Callable[..., None], *args: Any) -> Any:
    """Run ``target(*args, queue)`` in a spawned process and return what it puts on ``queue``; a fresh process,
    so no earlier measurement's peak or allocator state reaches this one."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    # Poll so that a child that dies (an exception) fails the benchmark instead of hanging it.
    while True:
        try:
            result = queue.get(timeout=1.0)
        except queue_module.Empty:
            if not process.is_alive():
                raise RuntimeError(
                    f"{target.__name__} failed (exit code {process.exitcode}); see its traceback above."
                ) from None
            continue
        process.join()
        return result
