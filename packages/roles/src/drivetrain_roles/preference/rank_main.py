"""Entry module of one rank spawned by ``drivetrain dpo|rm --nproc N``: ``python -m ... <command> <arguments>``.

User errors end the rank with a one-line message handed to the launcher (which prints one for all ranks).
"""

from __future__ import annotations

import sys

import click
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.errors import DrivetrainError

from ..sft.launch import INTERRUPTED, report_rank_error
from .command import dpo, rm

COMMANDS = {"dpo": dpo, "rm": rm}


def main() -> None:
    name, arguments = sys.argv[1], sys.argv[2:]
    try:
        COMMANDS[name].main(arguments, prog_name=f"drivetrain {name}", standalone_mode=False)
    except (DrivetrainError, ConfigError, click.ClickException) as e:
        report_rank_error(f"drivetrain {name}: error: {' '.join(str(e).split())}")
        sys.exit(1)
    except (KeyboardInterrupt, click.exceptions.Abort):
        sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main()
