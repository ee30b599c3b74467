"""Entry module of one rank spawned by ``drivetrain grpo --nproc N`` (``python -m drivetrain_roles.grpo.rank_main``)."""

from __future__ import annotations

from ..jobs.launch import rank_main
from .command import grpo


def main() -> None:
    rank_main(grpo, "grpo")


if __name__ == "__main__":
    main()
