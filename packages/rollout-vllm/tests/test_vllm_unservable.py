"""Models vLLM cannot serve are refused with one error naming the model, the reason and the fix (vLLM
environment; skipped where vLLM is not installed)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import create_rollout
from drivetrain_engine_core.testing import make_tiny_model_dir


def test_heads_vllms_cpu_attention_has_no_kernel_for_are_refused_before_it_starts(tmp_path):
    """The default tiny model (heads of 8) used to start and then fail inside vLLM's kernel at generate."""
    model = make_tiny_model_dir(tmp_path / "lm", arch="qwen2")
    with pytest.raises(ConfigError) as error:
        create_rollout("vllm", model_path=str(model))
    message = str(error.value)
    assert f"rollout 'vllm' cannot serve {model}: its attention heads have size 8" in message
    assert "64" in message and "rollout.name=hf" in message


def test_an_architecture_vllm_does_not_implement_is_refused(servable_model_dir, tmp_path):
    import shutil

    model = shutil.copytree(servable_model_dir, tmp_path / "unknown")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ConfigError) as error:
        create_rollout("vllm", model_path=str(model))
    message = str(error.value)
    assert message.startswith(f"rollout 'vllm' cannot serve {model} (architecture NoSuchModelForCausalLM)")
    assert "are not supported for now" in message and "rollout.name=hf" in message
