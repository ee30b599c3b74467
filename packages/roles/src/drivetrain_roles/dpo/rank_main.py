"""Entry module of one rank spawned by ``drivetrain dpo --nproc N`` (``python -m drivetrain_roles.dpo.rank_main``)."""

from __future__ import annotations

from typing import NoReturn

from ..jobs.launch import rank_main
from ..preference.command import dpo


def main() -> NoReturn:
    rank_main(dpo, "dpo")


if __name__ == "__main__":
    main()
