"""The entry module of every rank that ``drivetrain <command> --nproc N`` spawns:
``python -m drivetrain_roles.jobs.rank_entry <command> [ARGS]...``.

The command is looked up by name among the commands the ``drivetrain`` root offers (core's CLI, filled by every
plugin's ``register_commands`` hook), so a third party's job command gets ``--nproc`` as roles' own do, and an
outer launcher runs any of them the same way (``torchrun --nproc-per-node 2 -m drivetrain_roles.jobs.rank_entry
sft ...``). The rank then runs through :func:`~.launch.rank_main`: one line per user error, crash reports for
the launcher, a quiet Ctrl-C.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn

import click

from .launch import RANK_ENTRY, rank_main
from .rank_failures import report_rank_error


def registered_commands() -> dict[str, click.Command]:
    """Every command of the ``drivetrain`` root by name: the built-in ones and those the plugins registered.

    NOTE: the root's own lookup also prints every plugin problem on stderr; the launcher printed them once
    already, so the plugins' ``register_commands`` hooks are called here directly (the same hooks, with the
    same rules for names several plugins claim), and a rank says nothing unless its command is missing.
    """
    from drivetrain_engine_core.job import build_cli, plugins

    root = build_cli()
    plugins().register_commands(root)
    return dict(root.commands)


def unknown_command_message(name: str, known: Sequence[str]) -> str:
    """The one line for a rank asked to run a command nobody registered."""
    return (
        f"drivetrain: error: no command {name!r} is registered; the registered commands are "
        f"{', '.join(sorted(known))}. Run `python -m {RANK_ENTRY} <command> [ARGS]...` with one of them, "
        "and see `drivetrain plugins` for a plugin that did not load."
    )


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run this rank of ``drivetrain <argv[0]> <argv[1:]>`` (default: this process's arguments).

    An unknown command name is one line (handed to drivetrain's launcher, else printed) and exit status 1.
    """
    name, *arguments = list(sys.argv[1:] if argv is None else argv) or [""]
    commands = registered_commands()
    if name not in commands:
        report_rank_error(unknown_command_message(name, list(commands)))
        sys.exit(1)
    rank_main(commands[name], name, arguments)


if __name__ == "__main__":
    main()
