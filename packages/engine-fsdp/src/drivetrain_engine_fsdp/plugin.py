"""The ``fsdp`` entry point: registers the FSDP2 engine and its checkpoint merger by name (nothing heavy)."""

from drivetrain_engine_core.backend import hookimpl

ENGINE = "drivetrain_engine_fsdp.engine:FSDPEngine"
CONFIG = "drivetrain_engine_fsdp.config:FSDPEngineConfig"
MERGER = "drivetrain_engine_fsdp.merger:FSDPCheckpointMerger"


@hookimpl
def register_engines(registry):
    for model_type in ("language_model", "value_model"):
        registry.register(
            model_type=model_type, backend="fsdp", devices=("cpu", "cuda"), engine=ENGINE, config=CONFIG
        )


@hookimpl
def register_checkpoint_mergers(registry):
    registry.register("fsdp", MERGER)
