"""Core builds engine and model configs without OmegaConf; it accepts, converts and refuses values as the
commands' OmegaConf layer does, with the same messages (OmegaConf's own checks are the reference)."""

from __future__ import annotations

from typing import Any

import pytest
from drivetrain_engine_core.backend import ConfigError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, config_from_dict
from drivetrain_roles.runtime.command_config import build_config

CASES: list[tuple[type, dict[str, Any]]] = [
    (ModelConfig, {"path": "/m"}),
    (ModelConfig, {"path": 5}),
    (ModelConfig, {"path": "/m", "gradient_checkpointing": "yes"}),
    (ModelConfig, {"path": "/m", "gradient_checkpointing": 0}),
    (ModelConfig, {"path": "/m", "gradient_checkpointing": "maybe"}),
    (ModelConfig, {"path": "/m", "model_type": "value_model"}),
    (ModelConfig, {"path": "/m", "model_type": "reward"}),
    (ModelConfig, {"path": "/m", "lora": {"rank": "4", "alpha": "5e-3", "target_modules": ["q_proj"]}}),
    (ModelConfig, {"path": "/m", "lora": {"rank": 4.5}}),
    (ModelConfig, {"path": "/m", "lora": {"rank": True}}),
    (ModelConfig, {"path": "/m", "lora": {"rank": 0}}),
    (ModelConfig, {"path": "/m", "lora": {"rnak": 4}}),
    (ModelConfig, {"path": "/m", "lora": {"target_modules": "q_proj"}}),
    (ModelConfig, {"path": "/m", "lora": 3}),
    (ModelConfig, {"path": "/m", "lora": None}),
    (OptimizerConfig, {"lr": 3, "betas": [0.9, 0.95], "clip_grad": None, "total_steps": 10}),
    (OptimizerConfig, {"betas": [0.9]}),
    (OptimizerConfig, {"lr": "fast"}),
    (OptimizerConfig, {"warmup_steps": None}),
    (OptimizerConfig, {"lr_schedule": "cosine"}),
    (MicroBatchConfig, {"max_tokens": 64}),
    (MicroBatchConfig, {"micro_batch_size": 2, "max_tokens": 64}),
]


def _outcome(build: Any) -> Any:
    try:
        return build()
    except ConfigError as e:
        return f"ConfigError: {e}"


@pytest.mark.parametrize(("cls", "values"), CASES)
def test_core_builder_agrees_with_the_omegaconf_layer(cls, values) -> None:
    core = _outcome(lambda: config_from_dict(cls, values))
    layered = _outcome(lambda: build_config(cls, [values], where=cls.__name__))
    assert core == layered


def test_a_missing_required_field_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^ModelConfig\.path is required and has no default; set it\.$"):
        config_from_dict(ModelConfig, {})
