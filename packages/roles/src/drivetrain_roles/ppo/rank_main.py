"""Entry module of one rank spawned by ``drivetrain ppo --nproc N`` (``python -m drivetrain_roles.ppo.rank_main``)."""

from __future__ import annotations

from typing import NoReturn

from ..jobs.launch import rank_main
from .command import ppo


def main() -> NoReturn:
    rank_main(ppo, "ppo")


if __name__ == "__main__":
    main()
