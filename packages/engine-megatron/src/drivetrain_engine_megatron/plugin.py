"""drivetrain plugin entry point of the Megatron-Core backend (imports nothing heavy)."""

from drivetrain_engine_core.backend import hookimpl

_ENGINE = "drivetrain_engine_megatron.engine:MegatronEngine"
_CONFIG = "drivetrain_engine_megatron.config:MegatronEngineConfig"


@hookimpl
def register_engines(registry):
    for model_type in ("language_model", "value_model"):
        registry.register(
            model_type=model_type, backend="megatron", devices=("cpu", "cuda"), engine=_ENGINE, config=_CONFIG
        )


@hookimpl
def register_checkpoint_mergers(registry):
    registry.register("megatron", "drivetrain_engine_megatron.merger:MegatronCheckpointMerger")
