"""Processes end as Python ends them, minus the teardown where gloo's threads can abort a finished run.

Regression: about 1 in 10 two-rank CPU runs (``drivetrain sft --nproc 2``, ``drivetrain rm --nproc 2``, also
in CI) lost a rank after its work was saved: "terminate called without an active exception" (SIGABRT), from a
gloo worker thread releasing a collective's tensor while the interpreter tore itself down (core dump: main
thread in ``Py_FinalizeEx``'s garbage collection, the worker in ``ProcessGroupGloo::runLoop`` ->
``THPVariable_clear`` -> ``take_gil`` -> ``pthread_exit``). The race itself is too rare to test; these tests
check that the console script ends without that teardown and that nothing Python does before it is lost.
"""

from __future__ import annotations

import subprocess
import textwrap

from drivetrain_engine_core.testing.child_process import TEARDOWN_MARKER, TEARDOWN_PROBE, run_python

# A module-level object with a finalizer (it prints only if the interpreter tears its modules down), then
# what Python does before that teardown: exit handlers, non-daemon threads, a thread pool, buffered output.
PROBES = TEARDOWN_PROBE + textwrap.dedent(
    """
    import atexit, sys, threading, time

    atexit.register(lambda: print("exit handler ran"))

    def late_writer():
        time.sleep(0.3)
        print("non-daemon thread finished")

    threading.Thread(target=late_writer).start()
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)  # its idle worker is a non-daemon thread that waits for work until told to stop
    pool.submit(print, "pool task ran")
    sys.stdout.write("buffered, no newline")
    """
)


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    return run_python(PROBES + textwrap.dedent(body))


def test_exit_process_keeps_what_python_does_before_its_teardown_and_skips_the_teardown() -> None:
    result = run_child(
        """
        from drivetrain_engine_core._process_exit import run_then_exit
        run_then_exit(lambda: sys.exit(3))
        """
    )
    assert result.returncode == 3, result.stderr
    assert "buffered, no newline" in result.stdout
    assert "non-daemon thread finished" in result.stdout
    assert "pool task ran" in result.stdout  # and its idle worker did not keep the process alive
    assert "exit handler ran" in result.stdout
    assert TEARDOWN_MARKER not in result.stdout


def test_exit_statuses_follow_python() -> None:
    """``None`` is 0, a message is printed and gives 1, an uncaught exception is a traceback and 1."""
    cases = {
        "run_then_exit(lambda: None)": (0, ""),
        "run_then_exit(lambda: sys.exit('drivetrain: stopped'))": (1, "drivetrain: stopped"),
        "run_then_exit(lambda: 1 / 0)": (1, "ZeroDivisionError: division by zero"),
    }
    for call, (code, stderr) in cases.items():
        result = run_child(f"from drivetrain_engine_core._process_exit import run_then_exit\n{call}\n")
        assert result.returncode == code, (call, result.stderr)
        assert stderr in result.stderr, call
        assert TEARDOWN_MARKER not in result.stdout


def test_the_drivetrain_console_script_ends_without_the_teardown() -> None:
    """The installed ``drivetrain`` script and ``python -m drivetrain_engine_core`` both go through ``run``."""
    result = run_child(
        """
        sys.argv = ["drivetrain", "--version"]
        from drivetrain_engine_core._cli import run
        run()
        """
    )
    assert result.returncode == 0, result.stderr
    assert "drivetrain, version" in result.stdout
    assert TEARDOWN_MARKER not in result.stdout
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "drivetrain"]
    assert script.value == "drivetrain_engine_core._cli:run"
