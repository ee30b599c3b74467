"""``drivetrain grpo``: the click command; torch and the trainer are imported only when it runs."""

from __future__ import annotations

from ..jobs.command import job_command

grpo = job_command(
    "grpo",
    job="drivetrain_roles.grpo.trainer:GRPOTrainer",
    config="drivetrain_roles.grpo.config:GRPOConfig",
    help="""GRPO; with no arguments, the arithmetic model is warmed up by SFT, then learns from exact-answer rewards.

    OVERRIDES are dotted config values such as rollout.n=8 or trainer.total_steps=100; --help-config lists
    every field, --print-config shows the resolved config.
    """,
)
