"""The ``drivetrain`` command line: built-in ``plugins`` and ``engines`` listings, plus plugin commands.

drivetrain-roles adds the job commands (``sft``, ``dpo``, ``rm``, ``grpo``) and ``env``; drivetrain-ckpt-tools
adds ``ckpt``.

Plugins add sub-commands through the ``register_commands(cli)`` hook when the CLI first looks up a command.
Plugins that failed to load, keys that several plugins registered, and a plugin whose command registration
fails are reported on stderr whatever command runs, and the other commands keep working. Errors users can
fix (:class:`~.errors.DrivetrainError`, :class:`~.errors.ConfigError` among them) end the command with a short message
and exit status 1, never a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from typing import Any, NoReturn

import click

from ._errors import DrivetrainError
from ._plugins import DrivetrainPlugins, PluginInfo, plugins
from ._process_exit import run_then_exit

INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""


class DrivetrainGroup(click.Group):
    """Root group that pulls in plugin commands on first lookup and turns user errors into messages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._commands_from: DrivetrainPlugins | None = None

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._add_plugin_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._add_plugin_commands()
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0] if args else ""
        if name in FIRST_PARTY_COMMANDS and self.get_command(ctx, name) is None:
            raise click.UsageError(missing_command_message(name), ctx)
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except DrivetrainError as e:
            # One line, because click prints the message after "Error: " and users read it in a terminal.
            raise click.ClickException(" ".join(str(e).split("\n"))) from e
        except KeyboardInterrupt:
            # NOTE: click's own answer to Ctrl-C is "Aborted!" and exit status 1, which a script cannot tell
            # from a failure; a shell reports an interrupted command with 128 + SIGINT.
            name = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
            click.echo(f"{name}: interrupted.", err=True)
            raise SystemExit(INTERRUPTED) from None

    def _add_plugin_commands(self) -> None:
        loaded = plugins()
        if self._commands_from is loaded:
            return
        self._commands_from = loaded
        for problem in loaded.problems():
            click.echo(f"drivetrain: {problem}", err=True)
        for info in loaded.register_commands(self):
            click.echo(
                f"drivetrain: plugin {info.name!r} ({info.distribution} {info.version}) could not add its "
                f"commands: {info.error}",
                err=True,
            )
        for problem in loaded.command_problems():
            click.echo(f"drivetrain: {problem}", err=True)


FIRST_PARTY_COMMANDS: dict[str, str] = {
    "sft": "drivetrain-roles",
    "dpo": "drivetrain-roles",
    "rm": "drivetrain-roles",
    "grpo": "drivetrain-roles",
    "ppo": "drivetrain-roles",
    "env": "drivetrain-roles",
    "ckpt": "drivetrain-ckpt-tools",
}
"""Commands that drivetrain's own distributions add, so a missing one names what to install."""


def missing_command_message(name: str) -> str:
    """Why ``drivetrain <name>`` is unavailable and the install command (or where to look if installed)."""
    distribution = FIRST_PARTY_COMMANDS[name]
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return (
            f"No such command {name!r}: it comes from {distribution}, which is not installed. Install it with: "
            f"pip install {distribution}"
        )
    return (
        f"No such command {name!r}: {distribution} {version} is installed but its plugin did not add the "
        "command (disabled by DRIVETRAIN_DISABLE_PLUGINS, or failed to load); see `drivetrain plugins`."
    )


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def _plugin_lines(info: PluginInfo) -> list[str]:
    head = f"{info.name}: {info.distribution} {info.version} [{info.status}]"
    lines = [head if info.error is None else f"{head} {info.error}"]
    return lines + [f"    {line}" for line in info.registered]


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of text.")
def plugins_command(as_json: bool) -> None:
    """List every discovered plugin: distribution, version, status, what it registered, error if any."""
    infos = plugins().plugins
    if as_json:
        _echo_json([info.to_dict() for info in infos])
        return
    if not infos:
        click.echo("no drivetrain plugins installed; e.g. pip install drivetrain-engine-fsdp")
    for info in infos:
        click.echo("\n".join(_plugin_lines(info)))


@click.command("engines")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of text.")
def engines_command(as_json: bool) -> None:
    """List every registered (model_type, backend, device) with its engine class and distribution."""
    entries = plugins().engines.entries()
    if as_json:
        _echo_json([dataclasses.asdict(entry) for entry in entries])
        return
    if not entries:
        click.echo("no engines registered; install a backend, e.g. pip install drivetrain-engine-fsdp")
    for e in entries:
        click.echo(f"{e.model_type}/{e.backend}/{e.device} -> {e.engine} ({e.distribution} {e.version})")


def build_cli() -> DrivetrainGroup:
    """A fresh root group with the built-in commands (tests build one per case)."""

    @click.group(cls=DrivetrainGroup, name="drivetrain")
    @click.version_option(package_name="drivetrain-engine-core", prog_name="drivetrain")
    def root() -> None:
        """drivetrain: a backend-agnostic training engine for LLM post-training."""

    root.add_command(plugins_command)
    root.add_command(engines_command)
    return root  # type: ignore[return-value]


main = build_cli()


def run() -> NoReturn:
    """The ``drivetrain`` console script: the root command, ended without the interpreter's teardown (see
    :mod:`.process_exit`: torch's gloo threads can abort a finished run there)."""
    run_then_exit(lambda: main.main(prog_name="drivetrain"))


__all__ = [
    "FIRST_PARTY_COMMANDS",
    "INTERRUPTED",
    "DrivetrainGroup",
    "build_cli",
    "main",
    "missing_command_message",
    "run",
]
