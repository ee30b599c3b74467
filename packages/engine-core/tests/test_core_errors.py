"""One family per kind of mistake: ``except DrivetrainError`` catches a bad config too."""

from __future__ import annotations

import drivetrain_engine_core
import pytest
from drivetrain_engine_core import config, errors
from drivetrain_engine_core.config import LoraConfig, ModelConfig, config_from_dict
from drivetrain_engine_core.errors import ConfigError, DrivetrainError


def test_a_config_error_is_a_drivetrain_error_and_still_a_value_error() -> None:
    with pytest.raises(DrivetrainError, match=r"lora\.rank must be positive, got 0"):
        config_from_dict(ModelConfig, {"path": "/m", "lora": {"rank": 0}})
    with pytest.raises(ValueError, match=r"lora\.rank must be positive"):  # callers that caught ValueError
        LoraConfig(rank=0)
    assert drivetrain_engine_core.ConfigError is config.ConfigError is errors.ConfigError is ConfigError
