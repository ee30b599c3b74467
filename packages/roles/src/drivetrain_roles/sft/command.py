"""``drivetrain sft``: the click command; torch and the trainer are imported only when it runs."""

from __future__ import annotations

from ..jobs.command import job_command

sft = job_command(
    "sft",
    job="drivetrain_roles.sft.trainer:SFTTrainer",
    config="drivetrain_roles.sft.config:SFTConfig",
    help="""Supervised fine-tuning; with no arguments, a tiny model learns addition on CPU in about a minute.

    OVERRIDES are dotted config values such as engine.micro_batch.max_tokens=512 or trainer.total_steps=100;
    --help-config lists every field, --print-config shows the resolved config.
    """,
)
