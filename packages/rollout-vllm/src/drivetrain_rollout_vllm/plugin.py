"""drivetrain plugin of drivetrain-rollout-vllm: registers the ``vllm`` rollout (vLLM is imported only when one
is built, so this loads where vLLM is not installed and the rollout then names the install command)."""

from drivetrain_engine_core.hookspecs import hookimpl


@hookimpl
def register_rollouts(registry):
    registry.register("vllm", "drivetrain_rollout_vllm.rollout:VLLMRollout")
