"""Entry module of one rank spawned by ``drivetrain grpo --nproc N`` (``python -m drivetrain_roles.grpo.rank_main``)."""

from __future__ import annotations

from typing import NoReturn

from ..jobs.launch import rank_main
from .command import grpo


def main() -> NoReturn:
    rank_main(grpo, "grpo")


if __name__ == "__main__":
    main()
