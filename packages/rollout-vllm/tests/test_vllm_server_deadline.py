"""A vLLM server that hangs without dying is named within its request's deadline, and stopped.

The deadline is the trainer's side's (:mod:`drivetrain_rollout_vllm.process`), so the server here is the real
server module in this Python, made to hang with SIGSTOP before it answers: no vLLM is needed (its ``start``
request, which would build vLLM, is never sent), and the test runs in either environment in a few seconds."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.rollout import SamplingConfig
from drivetrain_rollout_vllm.deadline import (
    REQUEST_SECONDS_OPTION,
    REQUEST_SECONDS_VARIABLE,
    RequestDeadline,
    generation_tokens,
)
from drivetrain_rollout_vllm.process import ServerProcess
from drivetrain_rollout_vllm.wire import RolloutServerError


def test_a_server_stopped_mid_request_is_named_within_the_deadline_and_killed(tmp_path):
    server = ServerProcess.start(python=sys.executable, model_path=str(tmp_path), device="cpu")
    try:
        os.kill(server.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RolloutServerError) as error:
            server.call("served_weights", None, what="reading the served weights back", seconds=2)
        waited = time.monotonic() - started
        message = str(error.value)
        assert message.startswith(
            f"the vLLM server (pid {server.process.pid}, {sys.executable}) did not answer within 2 s while "
            "reading the served weights back (it was alive: hung, or slower than the deadline allows; set "
            f"{REQUEST_SECONDS_OPTION} to the seconds a request may take) and was stopped"
        )
        assert 2 <= waited < 5
        assert server.process.returncode == -signal.SIGKILL and server.connection is None
        with pytest.raises(RolloutServerError, match="is closed; build a new rollout"):
            server.call("served_weights", None, what="reading", seconds=2)
    finally:
        server.close()
        shutil.rmtree(server.log.parent, ignore_errors=True)


def test_the_deadline_follows_the_request():
    sampling = SamplingConfig(n=4, max_new_tokens=64)
    prompts = [[1, 2, 3], [4, 5]]
    assert generation_tokens(prompts, sampling) == 3 + 2 + 2 * 4 * 64
    derived = RequestDeadline()
    # 120 s of allowance, then 10 tokens/s and 10 MB/s: the slowest work the default waits for.
    assert derived.seconds(tokens=517) == pytest.approx(120 + 51.7)
    assert derived.seconds(nbytes=40_000_000) == pytest.approx(120 + 4)
    assert RequestDeadline(fixed_seconds=30).seconds(tokens=10**9, nbytes=10**12) == 30


def test_the_deprecated_variable_fixes_the_deadline_or_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(REQUEST_SECONDS_VARIABLE, "7200")
    assert RequestDeadline.from_environment() == RequestDeadline(fixed_seconds=7200.0)
    monkeypatch.delenv(REQUEST_SECONDS_VARIABLE)
    assert RequestDeadline.from_environment() == RequestDeadline()
    for bad in ("an hour", "0", "-5", "nan"):
        monkeypatch.setenv(REQUEST_SECONDS_VARIABLE, bad)
        with pytest.raises(ConfigError, match=f"{REQUEST_SECONDS_VARIABLE}='{bad}' is not a positive number"):
            RequestDeadline.from_environment()
