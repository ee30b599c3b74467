"""The ``toy-environment`` entry point: registers the game by name, imported only when an episode needs it."""

from drivetrain_engine_core.backend import hookimpl


@hookimpl
def register_environments(registry):
    registry.register("say-the-word", "drivetrain_toy_environment.game:SayTheWord")
