"""The rollout conformance kit for ``vllm`` (colocated), verification reading back what vLLM computes with.
Runs in the vLLM environment; skipped where vLLM is not installed. The kit builds a fresh rollout per test
(fresh weights are what it compares), so this module starts about ten vLLM instances, one at a time."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from drivetrain_engine_core.handoff import HandoffError, SentVersions
from drivetrain_engine_core.testing.policies import lora_adapters
from drivetrain_engine_core.testing.rollout_conformance import RolloutConformanceTests


class TestVLLMRolloutConformance(RolloutConformanceTests):
    rollout_name = "vllm"
    supports_adapters = False

    @pytest.fixture(scope="class")
    def model_dir(self, servable_model_dir):
        return servable_model_dir

    def test_adapter_streams_are_refused_naming_the_fix(self, model_dir):
        rollout = self.make(model_dir)
        with pytest.raises(
            HandoffError, match=r"merged weights only; hand off with weight_buckets\(lora='merged'\)"
        ):
            rollout.update_weights(
                self.stream(SentVersions(), lora_adapters(model_dir, seed=1), 1, lora="adapter")
            )
        assert rollout.weights_version is None
