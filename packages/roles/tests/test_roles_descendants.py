"""The ``drivetrain sft --nproc`` launcher returns when its ranks end, whatever processes they left behind."""

from __future__ import annotations

import subprocess
import sys
import time


def test_a_launch_whose_grandchild_holds_the_output_pipe_returns() -> None:
    # The rank starts in a new session, as torch's elastic launcher starts ranks, and exits at once; its own
    # child keeps stdout open for 300 s. A reader of the launcher's output (pytest, a CI log,
    # `drivetrain sft --nproc 2 | tee`) must see the end of the output when the launch ends.
    rank = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])"
    launcher = (
        "import subprocess, sys; from drivetrain_roles.runtime.descendants import owning_descendants\n"
        "with owning_descendants():\n"
        f"    subprocess.run([sys.executable, '-c', {rank!r}], start_new_session=True)"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30


def test_a_process_started_before_the_launch_survives_it() -> None:
    # A test process that ran megatron's checkpoint writer (a multiprocessing manager it keeps for the
    # process's life) and then launched ranks lost that manager: the launch killed every descendant, and the
    # next in-process save failed with a broken pipe.
    launcher = (
        "import subprocess, sys; from drivetrain_roles.runtime.descendants import owning_descendants\n"
        "earlier = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "with owning_descendants():\n"
        "    during = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(earlier.poll() is None, during.poll() is None)\n"
        "earlier.kill()\n"
    )
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]  # the earlier one still runs; the launch's one is gone
