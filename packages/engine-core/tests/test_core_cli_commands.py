"""The ``drivetrain`` CLI through click's CliRunner: listings, plugin commands, failures, user errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import PluginError, hookimpl
from drivetrain_engine_core.job import build_cli, plugins
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint

PLUGIN_DISTRIBUTIONS = {
    "drivetrain-engine-fsdp",
    "drivetrain-engine-megatron",
    "drivetrain-roles",
    "drivetrain-ckpt-tools",
}


@hookimpl
def _register_hello_engines(registry):
    registry.register(
        model_type="language_model",
        backend="hello",
        devices=["*"],
        engine="hello_pkg:E",
        config="hello_pkg:C",
    )


@hookimpl
def _register_hello_commands(cli):
    @cli.command("hello")
    @click.option("--name", default="world")
    def hello(name: str) -> None:
        click.echo(f"hello {name}")

    @cli.command("explode")
    def explode() -> None:
        raise PluginError("engine 'x' is missing.\nInstall it with: pip install x")


@hookimpl
def _register_half_commands(cli):
    cli.add_command(click.Command("half", callback=lambda: None))
    raise RuntimeError("commands hook failed midway")


@hookimpl
def _register_hijacking_commands(cli):
    cli.add_command(click.Command("mine", callback=lambda: None))
    cli.add_command(click.Command("engines", callback=lambda: click.echo("HIJACKED")))


HELLO = SimpleNamespace(register_engines=_register_hello_engines, register_commands=_register_hello_commands)
HALF = SimpleNamespace(register_commands=_register_half_commands)
HIJACK = SimpleNamespace(register_commands=_register_hijacking_commands)


@pytest.fixture
def fake_cli():
    entry_points = [
        InMemoryEntryPoint(name="hello", plugin=HELLO, distribution="drivetrain-hello"),
        InMemoryEntryPoint(name="half", plugin=HALF, distribution="drivetrain-half", version="0.0.9"),
        InMemoryEntryPoint(
            name="gone", plugin=ImportError("cannot import name 'gone'"), distribution="drivetrain-gone"
        ),
    ]
    reset_plugins()
    plugins(lambda: get_plugin_manager(entry_points=entry_points, disabled=[]))
    yield build_cli()
    reset_plugins()


def test_listings_as_json_and_text(fake_cli):
    runner = CliRunner()
    result = runner.invoke(fake_cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    assert listed["hello"]["status"] == "loaded"
    assert listed["hello"]["registered"] == [
        "engine language_model/hello/* -> hello_pkg:E",
        "command explode",
        "command hello",
    ]
    assert (listed["gone"]["status"], listed["gone"]["error"]) == (
        "failed",
        "ImportError: cannot import name 'gone'",
    )
    assert listed["half"]["error"] == "register_commands: RuntimeError: commands hook failed midway"
    engines = json.loads(runner.invoke(fake_cli, ["engines", "--json"]).stdout)
    assert engines == [
        {
            "model_type": "language_model",
            "backend": "hello",
            "device": "*",
            "engine": "hello_pkg:E",
            "config": "hello_pkg:C",
            "plugin": "hello",
            "distribution": "drivetrain-hello",
            "version": "0.1.0",
        }
    ]
    text = runner.invoke(fake_cli, ["engines"]).stdout
    assert text == "language_model/hello/* -> hello_pkg:E (drivetrain-hello 0.1.0)\n"
    assert "gone: drivetrain-gone 0.1.0 [failed] ImportError" in runner.invoke(fake_cli, ["plugins"]).stdout


def test_plugin_commands_and_a_failing_registration(fake_cli):
    result = CliRunner().invoke(fake_cli, ["hello", "--name", "drivetrain"])
    assert result.exit_code == 0
    assert result.stdout == "hello drivetrain\n"
    failed_to_load, failed_commands = result.stderr.splitlines()
    assert failed_to_load.startswith(
        "drivetrain: plugin 'gone' (drivetrain-gone 0.1.0) failed to load: ImportError: cannot import name 'gone'"
    )
    assert failed_commands == (
        "drivetrain: plugin 'half' (drivetrain-half 0.0.9) could not add its commands: "
        "register_commands: RuntimeError: commands hook failed midway"
    )
    missing = CliRunner().invoke(fake_cli, ["half"])
    assert missing.exit_code == 2 and "No such command 'half'" in missing.stderr


def test_user_errors_exit_with_one_line(fake_cli):
    result = CliRunner().invoke(fake_cli, ["explode"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "Error: engine 'x' is missing. Install it with: pip install x"
    assert "Traceback" not in result.output


def test_ctrl_c_is_one_line_and_exit_status_130(fake_cli):
    """click's own "Aborted!" and status 1 read as a failure to a script; a shell says 130 for Ctrl-C."""

    def wait() -> None:
        raise KeyboardInterrupt  # Ctrl-C while the command works

    fake_cli.add_command(click.Command("wait", callback=wait))
    result = CliRunner().invoke(fake_cli, ["wait"])
    assert (
        result.stderr.splitlines()[-1] == "drivetrain wait: interrupted."
    )  # after the fake plugins' warnings
    assert result.exit_code == 130 and "Aborted" not in result.output


def test_real_installed_plugins_are_listed():
    reset_plugins()
    try:
        result = CliRunner().invoke(build_cli(), ["plugins", "--json"])
        engines = CliRunner().invoke(build_cli(), ["engines", "--json"])
    finally:
        reset_plugins()
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert {p["distribution"] for p in listed} >= PLUGIN_DISTRIBUTIONS
    for plugin in listed:
        assert plugin["status"] in ("loaded", "failed"), plugin
        assert (plugin["status"] == "failed") == bool(plugin["error"]), plugin
    assert engines.exit_code == 0
    loaded = {p["name"] for p in listed if p["status"] == "loaded"}
    assert {e["plugin"] for e in json.loads(engines.stdout)} <= loaded


@hookimpl
def _register_rival_hello(cli):
    cli.add_command(click.Command("hello", callback=lambda: click.echo("rival hello")))


RIVAL = SimpleNamespace(register_commands=_register_rival_hello)


def _invoke(entry_points, *commands):
    reset_plugins()
    plugins(lambda: get_plugin_manager(entry_points=entry_points, disabled=[]))
    try:
        cli, runner = build_cli(), CliRunner()
        return [runner.invoke(cli, list(command)) for command in commands]
    finally:
        reset_plugins()


def test_a_plugin_cannot_replace_drivetrains_own_command():
    """``add_command`` overwrites: a plugin registering ``engines`` made ``drivetrain engines`` print its output,
    with no word of it anywhere. drivetrain's command is kept; the plugin's other commands stay."""
    entry_points = [
        InMemoryEntryPoint(name="hello", plugin=HELLO, distribution="drivetrain-hello"),
        InMemoryEntryPoint(name="hijack", plugin=HIJACK, distribution="drivetrain-hijack"),
    ]
    engines, mine = _invoke(entry_points, ["engines"], ["mine"])
    assert engines.exit_code == 0 and "HIJACKED" not in engines.stdout
    assert "language_model/hello/*" in engines.stdout
    assert (
        "drivetrain: plugin 'hijack' (drivetrain-hijack 0.1.0) may not replace drivetrain's own command 'engines'"
        in engines.stderr
    )
    assert mine.exit_code == 0


def test_a_command_two_plugins_add_is_a_conflict_neither_wins():
    """Entry-point order decided: a plugin named to load first could take ``sft`` from drivetrain-roles, or a later
    one replace it. As with engines, there is no precedence: neither is offered, and both are named."""
    entry_points = [
        InMemoryEntryPoint(name="aaa", plugin=RIVAL, distribution="drivetrain-rival"),
        InMemoryEntryPoint(name="hello", plugin=HELLO, distribution="drivetrain-hello"),
    ]
    (hello, explode) = _invoke(entry_points, ["hello"], ["explode", "--help"])
    assert hello.exit_code == 2 and "No such command 'hello'" in hello.stderr
    assert (
        "drivetrain: command 'hello' is added by several plugins: 'aaa' (drivetrain-rival 0.1.0), 'hello' "
        "(drivetrain-hello 0.1.0). There is no precedence, so neither is offered"
    ) in hello.stderr
    assert explode.exit_code == 0, "the plugins' other commands stay"


def test_every_cli_of_a_process_gets_the_plugins_commands(fake_cli):
    """The plugins are loaded once per process and serve every CLI built in it; the second CLI took the commands
    the first had registered for a conflict with themselves and offered none."""
    for cli in (fake_cli, build_cli()):
        result = CliRunner().invoke(cli, ["hello", "--name", "again"])
        assert (result.exit_code, result.stdout) == (0, "hello again\n")
