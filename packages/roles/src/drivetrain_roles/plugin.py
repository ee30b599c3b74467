"""drivetrain plugin of drivetrain-roles: the actor/critic/reference roles and the ``drivetrain sft`` command."""

from drivetrain_engine_core.hookspecs import hookimpl


@hookimpl
def register_roles(registry):
    registry.register("actor", "drivetrain_roles.actor:Actor")
    registry.register("critic", "drivetrain_roles.critic:Critic")
    registry.register("reference", "drivetrain_roles.reference:Reference")
    registry.register("sft", "drivetrain_roles.sft.trainer:SFTTrainer")


@hookimpl
def register_commands(cli):
    from drivetrain_roles.sft.command import sft

    cli.add_command(sft)
