"""The core conformance kit on a single-process MegatronEngine (TP = PP = DP = 1, gloo world of one)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.testing.conformance import EngineConformanceTests

pytestmark = pytest.mark.slow


class TestMegatronEngineConformance(EngineConformanceTests):
    backend = "megatron"
    supports_lora = False
    # bf16 checkpoints fail inside megatron's optimizer (issue #10 item 3); enabled with its fix.
    skip_tests = frozenset({"test_low_precision_checkpoint_round_trip_is_bit_exact"})
