"""Entry module of one rank spawned by ``drivetrain sft --nproc N`` (``python -m drivetrain_roles.sft.rank_main``).

User errors end the rank with a one-line message (as the ``drivetrain`` CLI does), not a traceback.
"""

from __future__ import annotations

import sys

import click
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.errors import DrivetrainError

from .command import sft


def main() -> None:
    try:
        sft.main(prog_name="drivetrain sft", standalone_mode=False)
    except (DrivetrainError, ConfigError, click.ClickException) as e:
        click.echo(f"drivetrain sft: error: {' '.join(str(e).split())}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
