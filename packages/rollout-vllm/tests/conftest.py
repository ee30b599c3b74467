"""The tiny model vLLM can serve: make_tiny_model_dir's with heads of 64 (vLLM's CPU attention has no kernel for
the default tiny heads of 8)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.testing import make_tiny_model_dir

SERVABLE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="session")
def servable_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lm"), arch="qwen2", **SERVABLE)
