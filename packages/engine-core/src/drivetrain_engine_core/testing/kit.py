"""What the engine and rollout conformance kits share: the device and model architecture they run on, the
inherited tests a subclass opts out of, and the tiny model directory of the class."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from drivetrain_engine_core.testing.device import device_under_test
from drivetrain_engine_core.testing.models import make_tiny_model_dir


class KitBase:
    """Class attributes and fixtures of every conformance kit (:class:`EngineConformanceTests`,
    :class:`RolloutConformanceTests`)."""

    device: ClassVar[str] = device_under_test()
    """``$DRIVETRAIN_TEST_DEVICE`` (``cpu`` unless the GPU lane sets ``cuda``)."""
    arch: ClassVar[str] = "qwen2"
    """The tiny model's architecture (:func:`~drivetrain_engine_core.testing.make_tiny_model_dir`)."""
    skip_tests: ClassVar[frozenset[str]] = frozenset()
    """Names of inherited tests that make no sense for the implementation under test."""

    @pytest.fixture(autouse=True)
    def _skip_unsupported(self, request: pytest.FixtureRequest) -> None:
        if request.function.__name__ in self.skip_tests:
            pytest.skip(f"{type(self).__name__} lists {request.function.__name__} in skip_tests")

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_tiny_model_dir(tmp_path_factory.mktemp("model"), arch=cls.arch)
