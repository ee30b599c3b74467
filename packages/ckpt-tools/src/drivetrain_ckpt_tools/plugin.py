"""The ``ckpt`` entry point: adds ``drivetrain ckpt ...`` to the command line (nothing heavy imported)."""

from drivetrain_engine_core.backend import hookimpl


@hookimpl
def register_commands(cli):
    from .commands import ckpt

    cli.add_command(ckpt)
