"""Entry module of one rank spawned by ``drivetrain sft --nproc N`` (``python -m drivetrain_roles.sft.rank_main``)."""

from __future__ import annotations

from typing import NoReturn

from ..jobs.launch import rank_main
from .command import sft


def main() -> NoReturn:
    rank_main(sft, "sft")


if __name__ == "__main__":
    main()
