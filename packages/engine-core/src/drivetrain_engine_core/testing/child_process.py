"""Checking how a child Python process ends: a probe that reports the interpreter's teardown, and a runner.

A drivetrain process ends without the interpreter's teardown (:func:`drivetrain_engine_core.job.run_then_exit`);
a child whose code starts with :data:`TEARDOWN_PROBE` prints :data:`TEARDOWN_MARKER` only if that teardown
runs (a module-level object's finalizer).
"""

from __future__ import annotations

import subprocess
import sys

TEARDOWN_MARKER = "teardown ran"
TEARDOWN_PROBE = f'''
import sys

class TeardownProbe:
    def __del__(self, out=sys.stdout):
        out.write("{TEARDOWN_MARKER}\\n")
        out.flush()

probe = TeardownProbe()
'''


def run_python(code: str, *arguments: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (``python -c code arguments...``); its exit status and output."""
    return subprocess.run(
        [sys.executable, "-c", code, *arguments], capture_output=True, text=True, timeout=timeout_s
    )
