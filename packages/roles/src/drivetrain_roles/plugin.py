"""drivetrain plugin of drivetrain-roles: the roles, the ``hf`` rollout, the ``http`` and ``calculator``
environments, the ``sft``/``dpo``/``rm``/``grpo``/``ppo`` commands and ``env``."""

from drivetrain_engine_core.backend import hookimpl


@hookimpl
def register_roles(registry):
    registry.register("actor", "drivetrain_roles.actor:Actor")
    registry.register("critic", "drivetrain_roles.critic:Critic")
    registry.register("reference", "drivetrain_roles.reference:Reference")
    registry.register("sft", "drivetrain_roles.sft.trainer:SFTTrainer")
    registry.register("dpo", "drivetrain_roles.dpo.trainer:DPOTrainer")
    registry.register("rm", "drivetrain_roles.rm.trainer:RMTrainer")
    registry.register("grpo", "drivetrain_roles.grpo.trainer:GRPOTrainer")
    registry.register("ppo", "drivetrain_roles.ppo.trainer:PPOTrainer")


@hookimpl
def register_rollouts(registry):
    registry.register("hf", "drivetrain_roles.rollout.hf:HFRollout")


@hookimpl
def register_environments(registry):
    registry.register("http", "drivetrain_roles.environments.http:HTTPEnvironment")
    registry.register("calculator", "drivetrain_roles.environments.calculator:CalculatorEnvironment")


@hookimpl
def register_commands(cli):
    from drivetrain_roles.grpo.command import grpo
    from drivetrain_roles.ppo.command import ppo
    from drivetrain_roles.preference.command import dpo, rm
    from drivetrain_roles.runtime.environment import env_command
    from drivetrain_roles.sft.command import sft

    for command in (sft, dpo, rm, grpo, ppo, env_command):
        cli.add_command(command)
