"""drivetrain plugin of drivetrain-roles: the roles, the ``hf`` rollout and the ``sft``/``grpo`` commands."""

from drivetrain_engine_core.hookspecs import hookimpl


@hookimpl
def register_roles(registry):
    registry.register("actor", "drivetrain_roles.actor:Actor")
    registry.register("critic", "drivetrain_roles.critic:Critic")
    registry.register("reference", "drivetrain_roles.reference:Reference")
    registry.register("sft", "drivetrain_roles.sft.trainer:SFTTrainer")
    registry.register("grpo", "drivetrain_roles.grpo.trainer:GRPOTrainer")


@hookimpl
def register_rollouts(registry):
    registry.register("hf", "drivetrain_roles.rollout.hf:HFRollout")


@hookimpl
def register_commands(cli):
    from drivetrain_roles.grpo.command import grpo
    from drivetrain_roles.sft.command import sft

    cli.add_command(sft)
    cli.add_command(grpo)
