"""The rollout conformance kit for ``vllm`` (colocated), verification reading back what vLLM computes with.
Runs in the vLLM environment; skipped where vLLM is not installed. The kit builds a fresh rollout per test
(fresh weights are what it compares), so this module starts about ten vLLM instances, one at a time."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from drivetrain_engine_core._handoff import SentVersions
from drivetrain_engine_core.job import create_rollout
from drivetrain_engine_core.rollout import HandoffError
from drivetrain_engine_core.testing.policies import lora_adapters
from drivetrain_engine_core.testing.rollout_conformance import RolloutConformanceTests

# vLLM's LoRA support on: the kit's adapter streams are served as adapters, its merged ones as weights.
OPTIONS = {"enable_lora": True, "max_lora_rank": 8}


class TestVLLMRolloutConformance(RolloutConformanceTests):
    rollout_name = "vllm"
    keeps_adapter_version_after_failure = True  # adapter versions are added whole

    @pytest.fixture(scope="class")
    def model_dir(self, servable_model_dir):
        return servable_model_dir

    def rollout_factory(self, model_dir, *, verify):
        return create_rollout("vllm", model_path=str(model_dir), verify=verify, options=OPTIONS)

    def test_adapter_streams_without_lora_support_are_refused_naming_the_fix(self, model_dir):
        rollout = create_rollout("vllm", model_path=str(model_dir))
        with pytest.raises(HandoffError, match=r"set rollout.options.enable_lora=true .*\(lora='merged'\)"):
            rollout.update_weights(
                self.stream(SentVersions(), lora_adapters(model_dir, seed=1), 1, lora="adapter")
            )
        assert rollout.weights_version is None
