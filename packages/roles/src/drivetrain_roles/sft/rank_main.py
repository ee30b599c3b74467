"""Entry module of one rank spawned by ``drivetrain sft --nproc N`` (``python -m drivetrain_roles.sft.rank_main``).

User errors end the rank with a one-line message handed to the launcher (which prints one for all ranks), not
a traceback; Ctrl-C ends it quietly.
"""

from __future__ import annotations

import sys

import click
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.errors import DrivetrainError

from .command import sft
from .launch import INTERRUPTED, report_rank_error


def main() -> None:
    try:
        sft.main(prog_name="drivetrain sft", standalone_mode=False)
    except (DrivetrainError, ConfigError, click.ClickException) as e:
        report_rank_error(f"drivetrain sft: error: {' '.join(str(e).split())}")
        sys.exit(1)
    except (KeyboardInterrupt, click.exceptions.Abort):
        sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main()
