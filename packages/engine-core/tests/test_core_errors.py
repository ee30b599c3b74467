"""One family per kind of mistake: ``except DrivetrainError`` catches a bad config too."""

from __future__ import annotations

import pytest
from drivetrain_engine_core import _config as config
from drivetrain_engine_core import _errors as errors
from drivetrain_engine_core.backend import ConfigError, DrivetrainError, LoraConfig, ModelConfig
from drivetrain_engine_core.job import config_from_dict


def test_a_config_error_is_a_drivetrain_error_and_still_a_value_error() -> None:
    with pytest.raises(DrivetrainError, match=r"lora\.rank must be positive, got 0"):
        config_from_dict(ModelConfig, {"path": "/m", "lora": {"rank": 0}})
    with pytest.raises(ValueError, match=r"lora\.rank must be positive"):  # callers that caught ValueError
        LoraConfig(rank=0)
    assert config.ConfigError is errors.ConfigError is ConfigError
