"""The device the test suites run on, chosen by one environment variable, and skips for what it cannot run.

CI runs everything on ``cpu``. The GPU lane (``.ci/gpu-lane``) sets ``DRIVETRAIN_TEST_DEVICE=cuda``: the
conformance kit and the backend tests that read :func:`device_under_test` then build their engines on CUDA, and
tests marked with :data:`requires_cuda` run instead of skipping.
"""

from __future__ import annotations

import os

import pytest

DEVICE_VARIABLE = "DRIVETRAIN_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def device_under_test() -> str:
    """``$DRIVETRAIN_TEST_DEVICE`` (``cpu`` when unset).

    Raises:
        ValueError: the variable names a device the suites do not run on.
    """
    device = os.environ.get(DEVICE_VARIABLE, "cpu")
    if device not in DEVICES:
        raise ValueError(f"{DEVICE_VARIABLE}={device!r} is not supported; use one of {list(DEVICES)}.")
    return device


def cuda_available() -> bool:
    import torch

    return device_under_test() == "cuda" and torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(
    not cuda_available(), reason=f"needs a CUDA device and {DEVICE_VARIABLE}=cuda (the GPU lane)"
)
"""Mark for tests that only mean something on a GPU (CI skips them cleanly)."""


def skip_unless_devices(world_size: int) -> None:
    """Skip a multi-rank test on CUDA when there are fewer GPUs than ranks (one GPU per rank)."""
    import torch

    if device_under_test() == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip(
            f"{world_size} ranks need {world_size} GPUs, this machine has {torch.cuda.device_count()}"
        )
