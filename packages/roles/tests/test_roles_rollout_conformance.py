"""The ``hf`` rollout against core's rollout conformance kit (versions, refusals, full, delta and adapter
streams, verification, log-probs equal to the plain Hugging Face model's)."""

from __future__ import annotations

from drivetrain_engine_core.testing.rollout_conformance import RolloutConformanceTests


class TestHFRolloutConformance(RolloutConformanceTests):
    rollout_name = "hf"
