"""Every blocking operation on the server's socket ends within the request's deadline: a server that takes the
connection and never reads (a bucket larger than the socket's buffer then blocks the sender), never answers, or
listens and never takes the connection is named and stopped, as a late answer is.

The server here is a stand-in in this Python's standard library (it listens on the socket the trainer names,
with the trainer's key, and then hangs), so no vLLM and no torch import is needed: the test runs in the main
suite in well under a second of CPU per case."""

from __future__ import annotations

import shutil
import signal
import sys
import time

import pytest
from drivetrain_rollout_vllm.deadline import REQUEST_SECONDS_OPTION
from drivetrain_rollout_vllm.process import ServerProcess
from drivetrain_rollout_vllm.wire import AUTHKEY_VARIABLE, RolloutServerError

DEADLINE_SECONDS = 2
LATENESS_SECONDS = 10  # how much later than its deadline the error may come on a loaded machine
BUCKET_BYTES = 4 << 20  # a real bucket's order (tens of MB); far over a Unix socket's buffer (~208 KB)

# argv: -m drivetrain_rollout_vllm.server SOCKET MODEL DEVICE (what ServerProcess starts), then the mode.
HUNG_SERVER = f"""
import os, sys, time
from multiprocessing.connection import Listener
key = bytes.fromhex(os.environ[{AUTHKEY_VARIABLE!r}])
with Listener(sys.argv[3], family="AF_UNIX", authkey=key) as listener:
    if "{{mode}}" == "takes the connection":
        connection = listener.accept()
    time.sleep(600)
"""


def hung_python(tmp_path, mode: str) -> str:
    """A 'Python' whose server listens and then hangs (``mode``: after taking the connection, or before)."""
    script = tmp_path / "hung_server.py"
    script.write_text(HUNG_SERVER.replace("{mode}", mode))
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


@pytest.fixture
def hung_server(tmp_path):
    server = ServerProcess.start(
        python=hung_python(tmp_path, "takes the connection"), model_path=str(tmp_path), device="cpu"
    )
    yield server
    server.close()
    shutil.rmtree(server.log.parent, ignore_errors=True)


@pytest.mark.timeout(60)  # without a bounded send, the bucket below blocks for good
@pytest.mark.parametrize(
    ("payload", "what"),
    [(bytes(BUCKET_BYTES), "receiving bucket 0 of version 1"), (None, "reading the served weights back")],
    ids=["a-bucket-it-never-reads", "an-answer-it-never-sends"],
)
def test_a_server_that_stops_reading_is_named_within_the_deadline_and_stopped(hung_server, payload, what):
    started = time.monotonic()
    with pytest.raises(RolloutServerError) as error:
        hung_server.call(
            "load_bucket" if payload else "served_weights",
            {},
            payload=None if payload is None else memoryview(payload),
            what=what,
            seconds=DEADLINE_SECONDS,
        )
    waited = time.monotonic() - started
    assert str(error.value).startswith(
        f"{hung_server.name} did not answer within {DEADLINE_SECONDS} s while {what} (it was alive: hung, or "
        f"slower than the deadline allows; set {REQUEST_SECONDS_OPTION} to the seconds a request may take) and "
        "was stopped"
    )
    assert DEADLINE_SECONDS <= waited < DEADLINE_SECONDS + LATENESS_SECONDS
    assert hung_server.process.returncode == -signal.SIGKILL and hung_server.connection is None


@pytest.mark.timeout(60)  # without a bounded handshake, the start blocks for good
def test_a_server_that_never_takes_the_connection_is_named_within_the_start_deadline(tmp_path):
    started = time.monotonic()
    with pytest.raises(RolloutServerError) as error:
        ServerProcess.start(
            python=hung_python(tmp_path, "never takes it"),
            model_path=str(tmp_path),
            device="cpu",
            seconds=DEADLINE_SECONDS,
        )
    waited = time.monotonic() - started
    assert f"did not take the trainer's connection within {DEADLINE_SECONDS} s and was stopped" in str(
        error.value
    )
    assert DEADLINE_SECONDS <= waited < DEADLINE_SECONDS + LATENESS_SECONDS
