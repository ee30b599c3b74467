"""The ``toy`` entry point: registers the engine by name, so listing plugins imports nothing heavy."""

from drivetrain_engine_core.backend import hookimpl


@hookimpl
def register_engines(registry):
    registry.register(
        model_type="language_model",
        backend="toy",
        devices=("*",),
        engine="drivetrain_toy_engine.engine:ToyEngine",
        config="drivetrain_toy_engine.config:ToyEngineConfig",
    )
