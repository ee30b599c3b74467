"""``drivetrain ppo``: the click command; torch and the trainer are imported only when it runs."""

from __future__ import annotations

from ..jobs.command import job_command

ppo = job_command(
    "ppo",
    job="drivetrain_roles.ppo.trainer:PPOTrainer",
    config="drivetrain_roles.ppo.config:PPOConfig",
    help="""PPO with a critic; with no arguments, the arithmetic model is warmed up by SFT, then learns from
    exact-answer rewards with GAE over a value model started from it.

    OVERRIDES are dotted config values such as algorithm.lam=0.95 or trainer.critic_warmup=5; --help-config
    lists every field, --print-config shows the resolved config.
    """,
)
