"""The test device comes from DRIVETRAIN_TEST_DEVICE, and a wrong value is one clear error."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.testing.device import DEVICE_VARIABLE, device_under_test


def test_device_defaults_to_cpu_and_follows_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_VARIABLE, raising=False)
    assert device_under_test() == "cpu"
    monkeypatch.setenv(DEVICE_VARIABLE, "cuda")
    assert device_under_test() == "cuda"
    monkeypatch.setenv(DEVICE_VARIABLE, "gpu")
    with pytest.raises(
        ValueError, match=r"DRIVETRAIN_TEST_DEVICE='gpu' is not supported; use one of \['cpu', 'cuda'\]"
    ):
        device_under_test()
