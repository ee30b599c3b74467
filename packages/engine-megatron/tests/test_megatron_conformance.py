"""The core conformance kit on a single-process MegatronEngine (TP = PP = DP = 1, gloo world of one)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.testing.conformance import EngineConformanceTests

# The GPU machine may lack megatron-core and mbridge: the lane skips these rather than failing them.
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = pytest.mark.slow


class TestMegatronEngineConformance(EngineConformanceTests):
    backend = "megatron"
