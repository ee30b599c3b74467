"""Ctrl-C's two presses (``jobs.interrupt``, ``jobs.ray_ctrl_c``): a rank's step loop, the ``--nproc`` launcher and
the Ray driver, without training.

The runs themselves: ``test_roles_sft`` (one process, then ``--resume``), ``test_roles_launch_failures`` (two
ranks) and ``test_roles_ray_cluster`` (two ranks on two Ray nodes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from drivetrain_roles.jobs.interrupt import StopRequests, forwarding_ctrl_c
from drivetrain_roles.jobs.rank_failures import ERROR_DIR_ENV

CHILD = """
import signal, sys, time
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # as a rank's step loop does
signal.signal(signal.SIGINT, lambda *_: (print("SIGINT", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(60)
"""


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next line


def test_the_first_ctrl_c_is_noted_the_second_interrupts_at_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))  # as drivetrain's launcher starts a rank
    before = signal.getsignal(signal.SIGINT)
    stop = StopRequests("sft")
    with pytest.raises(KeyboardInterrupt), stop.handled():
        assert (tmp_path / "stop-rank00000.pid").read_text() == str(os.getpid())
        ctrl_c()
        assert stop.requested
        ctrl_c()
        pytest.fail("the second Ctrl-C did not interrupt")
    assert signal.getsignal(signal.SIGINT) is before
    assert not (tmp_path / "stop-rank00000.pid").exists()


def test_the_launcher_hands_the_first_ctrl_c_to_the_lowest_rank_in_its_loop(tmp_path) -> None:
    ranks = [
        subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    try:
        for rank, process in enumerate(ranks):
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
            (tmp_path / f"stop-rank{rank:05d}.pid").write_text(str(process.pid))
        with pytest.raises(KeyboardInterrupt), forwarding_ctrl_c(tmp_path, "sft"):
            ctrl_c()
            assert ranks[0].communicate(timeout=30)[0] == "SIGINT\n"
            assert ranks[1].poll() is None  # the others learn it from rank 0 at the step boundary
            ctrl_c()
            pytest.fail("the second Ctrl-C did not stop the launch")
    finally:
        for process in ranks:
            process.kill()
            process.communicate()


BLOCKED_AT_START = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as a supervisor that starts the launcher may
from drivetrain_roles.jobs.interrupt import forwarding_ctrl_c
from drivetrain_roles.jobs.ray_ctrl_c import DriverCtrlC
for taking in (forwarding_ctrl_c(sys.argv[1], "sft"), DriverCtrlC("sft").handled()):
    try:
        with taking:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the driver's second press
            sys.exit("Ctrl-C stayed pending")
    except KeyboardInterrupt:
        pass
print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
"""


def test_a_launcher_or_driver_started_with_sigint_blocked_still_takes_ctrl_c(tmp_path) -> None:
    """A process that starts with SIGINT blocked (its supervisor's mask is inherited) kept a Ctrl-C pending."""
    taken = subprocess.run(
        [sys.executable, "-c", BLOCKED_AT_START, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert (taken.returncode, taken.stdout) == (0, "True\n"), taken.stderr  # and blocked again after


def test_before_any_rank_is_in_its_loop_ctrl_c_stops_the_launch_at_once(tmp_path) -> None:
    with pytest.raises(KeyboardInterrupt), forwarding_ctrl_c(tmp_path, "sft"):
        ctrl_c()
        pytest.fail("Ctrl-C was held although no rank could save")


def test_the_ray_driver_forwards_the_first_ctrl_c_once_and_stops_at_once_when_no_rank_can_save() -> None:
    from drivetrain_roles.jobs.ray_ctrl_c import DriverCtrlC

    sent: list[bool] = []
    taking = DriverCtrlC("sft")
    with taking.handled():
        taking.forward(lambda: sent.append(True) or True)
        assert sent == []  # nothing asked yet
        ctrl_c()  # noted only: Ray's client is not called inside the handler
        taking.forward(lambda: sent.append(True) or True)
        taking.forward(lambda: sent.append(True) or True)
        assert sent == [True]
        with pytest.raises(KeyboardInterrupt):
            ctrl_c()
    nobody = DriverCtrlC("sft")
    with pytest.raises(KeyboardInterrupt), nobody.handled():
        ctrl_c()
        nobody.forward(lambda: False)  # no rank in its step loop: nothing to save


def test_a_rank_whose_process_blocks_sigint_takes_it_in_its_step_loop(tmp_path, monkeypatch) -> None:
    """Ray's workers block SIGINT: a Ctrl-C sent on to a rank placed by Ray stayed pending and never stopped it."""
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    stop = StopRequests("sft")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as Ray starts its workers
    try:
        with stop.handled():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            assert stop.requested
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # blocked again outside the loop
    finally:
        if signal.SIGINT in signal.sigpending():
            signal.sigwait({signal.SIGINT})  # not left for pytest's own handler
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
