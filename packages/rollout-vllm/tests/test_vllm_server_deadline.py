"""A vLLM server that hangs without dying is named within its request's deadline, and stopped.

The deadline is the trainer's side's (:mod:`drivetrain_rollout_vllm.process`), so the server here is the real
server module in this Python, made to hang with SIGSTOP before it takes a bucket: no vLLM is needed (its
``start`` request, which would build vLLM, is never sent), and the test runs in either environment in a few
seconds. test_vllm_server_watch.py covers the other ways a server can hang, on a stand-in server."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest
import torch
from drivetrain_engine_core._handoff import SentVersions
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.rollout import SamplingConfig
from drivetrain_engine_core.testing.policies import stream
from drivetrain_rollout_vllm.deadline import (
    REQUEST_SECONDS_OPTION,
    REQUEST_SECONDS_VARIABLE,
    RequestDeadline,
    generation_tokens,
)
from drivetrain_rollout_vllm.process import ServerProcess
from drivetrain_rollout_vllm.wire import RolloutServerError, bucket_bytes, bucket_header


@pytest.mark.timeout(120)  # without a bounded send, the bucket blocks for good
def test_a_server_stopped_mid_hand_off_is_named_within_the_deadline_and_killed(tmp_path):
    # One 4 MiB tensor: one bucket, far over a Unix socket's buffer (~208 KB), as real buckets are (tens of MB).
    (bucket,) = stream(SentVersions(), {"model.embed_tokens.weight": torch.randn(1024, 1024)}, 1)
    payload = bucket_bytes(bucket)
    assert payload.nbytes == 4 << 20
    server = ServerProcess.start(python=sys.executable, model_path=str(tmp_path), device="cpu")
    try:
        os.kill(server.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RolloutServerError) as error:
            server.call(
                "load_bucket", bucket_header(bucket), payload=payload, what="receiving bucket 0", seconds=2
            )
        waited = time.monotonic() - started
        message = str(error.value)
        assert message.startswith(
            f"the vLLM server (pid {server.process.pid}, {sys.executable}) did not answer within 2 s while "
            "receiving bucket 0 (it was alive: hung, or slower than the deadline allows; set "
            f"{REQUEST_SECONDS_OPTION} to the seconds a request may take) and was stopped"
        )
        assert 2 <= waited < 2 + 10
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
