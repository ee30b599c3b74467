"""drivetrain plugin of drivetrain-rollout-vllm: registers the ``vllm`` rollout (colocated: vLLM in the trainer's
process; vLLM is imported only when it is looked up, so this loads where vLLM is not installed and the rollout
then names the install command) and ``vllm-server`` (separate: vLLM in its own process and Python)."""

from drivetrain_engine_core.backend import hookimpl


@hookimpl
def register_rollouts(registry):
    registry.register("vllm", "drivetrain_rollout_vllm.rollout:VLLMRollout")
    registry.register("vllm-server", "drivetrain_rollout_vllm.client:VLLMServerRollout")
