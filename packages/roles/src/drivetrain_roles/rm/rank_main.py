"""Entry module of one rank spawned by ``drivetrain rm --nproc N`` (``python -m drivetrain_roles.rm.rank_main``)."""

from __future__ import annotations

from typing import NoReturn

from ..jobs.launch import rank_main
from ..preference.command import rm


def main() -> NoReturn:
    rank_main(rm, "rm")


if __name__ == "__main__":
    main()
