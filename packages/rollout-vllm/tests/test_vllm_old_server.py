"""A trainer of this version against a real drivetrain-rollout-vllm 0.2.0 server (wire protocol 1, its source
taken from the 0.2.0 release commit): one error naming both versions, not the server's TypeError. No vLLM is
needed: the old server fails the start request before it would build vLLM."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from drivetrain_engine_core.rollout import HandoffError
from drivetrain_rollout_vllm import VLLMServerRollout
from drivetrain_rollout_vllm.process import ServerProcess
from drivetrain_rollout_vllm.wire import PROTOCOL

REPO = Path(__file__).resolve().parents[3]
RELEASE_0_2_0 = "5ce0386e698f"
"""The commit drivetrain-rollout-vllm 0.2.0 was cut from (.ci/releases.toml)."""


@pytest.fixture
def old_server(tmp_path):
    # The server of that release with the core it was released against (core's private modules move).
    sources = ["packages/rollout-vllm/src", "packages/engine-core/src"]
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", RELEASE_0_2_0, *sources], capture_output=True, check=False
    )
    if archive.returncode:
        pytest.skip(f"this clone lacks the 0.2.0 release commit {RELEASE_0_2_0}: {archive.stderr.decode()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    # The server's environment drops PYTHONPATH (the trainer's), so a wrapper puts the old source first.
    python = tmp_path / "python-0.2.0"
    path = ":".join(str(tmp_path / "old" / source) for source in sources)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{path}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    server = ServerProcess.start(python=str(python), model_path=str(tmp_path), device="cpu")
    yield server
    server.close()


def test_a_0_2_0_server_is_refused_naming_both_versions(old_server, tmp_path):
    with pytest.raises(HandoffError) as error:
        VLLMServerRollout(model_path=str(tmp_path), server=old_server)
    assert str(error.value).startswith(
        f"{old_server.name} runs drivetrain-rollout-vllm 0.2.0 (weight-stream "
    )
    assert str(error.value).endswith(
        f"speaks protocol {PROTOCOL}: install the same drivetrain-rollout-vllm version in both environments."
    )
