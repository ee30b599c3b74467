"""``drivetrain dpo`` and ``drivetrain rm``: one click command per pairwise trainer, built by
:func:`~drivetrain_roles.jobs.command.job_command`.

torch and the trainers are imported only when a command runs, so registering them stays cheap.
"""

from __future__ import annotations

from ..jobs.command import job_command

dpo = job_command(
    "dpo",
    job="drivetrain_roles.dpo.trainer:DPOTrainer",
    config="drivetrain_roles.dpo.config:DPOConfig",
    help="Direct Preference Optimisation; with no arguments, an SFT warm start of a tiny model on addition, then "
    "DPO on correct-vs-wrong answers, on CPU in a few minutes.\n\nOVERRIDES are dotted config values such as "
    "dpo.beta=0.2 or dpo.loss_type=ipo; --help-config lists every field.",
)

rm = job_command(
    "rm",
    job="drivetrain_roles.rm.trainer:RMTrainer",
    config="drivetrain_roles.rm.config:RMConfig",
    help="Bradley-Terry reward model; with no arguments, an SFT warm start of a tiny model on addition, then a "
    "reward model of correct-vs-wrong answers, on CPU in a few minutes.\n\nOVERRIDES are dotted config values "
    "such as trainer.total_steps=100; --help-config lists every field.",
)
