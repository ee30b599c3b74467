"""The command config layer: typed checks naming the field, close matches, presets, backend sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import click
import pytest
import yaml
from click.testing import CliRunner
from drivetrain_engine_core._plugins import get_plugin_manager
from drivetrain_engine_core.backend import ConfigError, EngineConfig, hookimpl
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint
from drivetrain_roles.runtime.command_config import (
    Preset,
    PresetChoice,
    build_config,
    config_options,
    describe_fields,
    load_config,
    to_plain,
    to_yaml,
)
from drivetrain_roles.runtime.command_config.layers import parse_override


@dataclass(kw_only=True, frozen=True)
class LoopConfig:
    """A training loop.

    Attributes:
        steps: optimizer steps.
        verbose: print more.
        files: input files.
        warmup: warm-up steps.
        length: ``short`` or ``long`` (picks the preset of that name).
    """

    steps: int = 10
    verbose: bool = False
    files: tuple[str, ...] = ()
    warmup: int = 1
    length: str = "short"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"loop.steps must be >= 1, got {self.steps}.")


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    """A section a preset sets.

    Attributes:
        decay_steps: steps of the decay.
    """

    decay_steps: int = 9

    def __post_init__(self) -> None:
        if self.decay_steps < 0:
            raise ConfigError(f"schedule.decay_steps must be >= 0, got {self.decay_steps}.")


@dataclass(kw_only=True, frozen=True)
class ToyBackendConfig(EngineConfig):
    """A backend with one knob.

    Attributes:
        knob: a backend-only setting.
    """

    backend: str = "toy"
    knob: int = 3


@dataclass(kw_only=True, frozen=True)
class DialBackendConfig(EngineConfig):
    """Another backend: its own knob, and its own default for a shared option.

    Attributes:
        dial: a backend-only setting.
    """

    backend: str = "dial"
    dial: int = 5
    seed: int = 7


def _engine() -> EngineConfig:
    return EngineConfig(backend="toy", micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=64))


LONG = Preset("long", {"loop": {"steps": 50, "warmup": 5}, "schedule": {"decay_steps": 49}})


@dataclass(kw_only=True, frozen=True)
class SectionsConfig:
    """A made-up command without an engine: its defaults are the field defaults, ``loop.length`` picks a preset.

    Attributes:
        schedule: the schedule.
        loop: the loop.
    """

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)

    presets: ClassVar[tuple[PresetChoice, ...]] = (PresetChoice(key="loop.length", presets={"long": LONG}),)


@dataclass(kw_only=True, frozen=True)
class CommandConfig(SectionsConfig):
    """A made-up command with an engine.

    Attributes:
        engine: the engine.
    """

    engine: EngineConfig = field(default_factory=_engine)


@hookimpl
def _register(registry):
    registry.register(
        model_type="language_model", backend="toy", devices=["*"], engine="m:E", config=ToyBackendConfig
    )
    registry.register(
        model_type="language_model", backend="dial", devices=["*"], engine="m:E", config=DialBackendConfig
    )


_ENTRY_POINT = InMemoryEntryPoint(
    name="toy", distribution="drivetrain-engine-toy", plugin=SimpleNamespace(register_engines=_register)
)


@pytest.fixture(scope="module")
def loaded():
    return get_plugin_manager(entry_points=[_ENTRY_POINT], disabled=[])


def build(loaded, *overrides: str) -> CommandConfig:
    return build_config(CommandConfig, [parse_override(o) for o in overrides], plugins=loaded)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loop.steps=abc", "loop.steps='abc' is not a valid int; write a whole number"),
        ("loop.steps=2.5", "loop.steps=2.5 is not a valid int; write a whole number"),
        ("loop.verbose=nope", "loop.verbose='nope' is not a valid bool; write true or false"),
        (
            "loop.files=/abs/a.jsonl",
            r"loop.files='/abs/a.jsonl' is not a valid tuple\[str, \.\.\.\]; write a list in brackets",
        ),
        ("engine.knob=x", "engine.knob='x' is not a valid int"),
        ("loop.steps=0", "loop.steps must be >= 1, got 0"),
        (
            "loop.step=3",
            r"unknown option loop.step; known options: \['files', 'length', 'steps', 'verbose', 'warmup'\]. "
            "Did you mean 'steps'",
        ),
        ("engine.knobb=1", "unknown option engine.knobb;.*Did you mean 'knob'"),
    ],
)
def test_every_value_is_checked_against_its_annotation_and_names_the_field(loaded, override, message):
    with pytest.raises(ConfigError, match=message):
        build(loaded, override)


def test_a_section_that_is_not_a_mapping_is_reported_with_the_files_value(loaded):
    """Once merged, ``loop: 5`` in the file was reported with an override's value (``loop={'steps': 3}``)."""
    with pytest.raises(
        ConfigError, match=r"^loop is a section of options, but the config file gives it the value 5;"
    ):
        build_config(
            CommandConfig, [{"loop": 5}, parse_override("loop.steps=3")], plugins=loaded, file_layers=1
        )
    with pytest.raises(ConfigError, match=r"^engine is a section of options, but it is given the value 4;"):
        build(loaded, "engine=4")


def test_defaults_come_from_the_dataclass_and_a_preset_applies_where_the_user_set_nothing(loaded):
    config = build(loaded)
    assert (config.loop, config.schedule) == (LoopConfig(steps=10, warmup=1), ScheduleConfig(decay_steps=9))
    config = build(loaded, "loop.length=long")  # the preset's values
    assert (config.loop.steps, config.loop.warmup, config.schedule.decay_steps) == (50, 5, 49)
    assert build(loaded, "loop.files=[a.jsonl]").loop.files == ("a.jsonl",)


def test_a_user_value_beats_the_preset_in_the_file_and_on_the_command_line(loaded):
    """The preset is a layer under the user's: a value the file or an override sets wins, whatever it equals
    (a value equal to the command's default too), and the preset fills only the rest."""
    file = {"loop": {"length": "long", "warmup": 1}}
    config = build_config(
        CommandConfig, [file, parse_override("schedule.decay_steps=3")], plugins=loaded, file_layers=1
    )
    assert (config.loop.steps, config.loop.warmup, config.schedule.decay_steps) == (50, 1, 3)


def test_a_bad_value_is_named_where_it_was_written_not_in_a_preset(loaded):
    """Regression: ``trainer.total_steps=-1`` was reported as ``optimizer.warmup_steps must be >= 0, got -1``
    (a value following it was built first)."""
    with pytest.raises(ConfigError, match=r"loop.steps must be >= 1, got -5"):
        build(loaded, "loop.length=long", "loop.steps=-5")
    with pytest.raises(
        ConfigError, match=r"^loop is a section of options, but the config file gives it the value 5;"
    ):
        build_config(
            CommandConfig, [{"loop": 5}, parse_override("loop.length=long")], plugins=loaded, file_layers=1
        )


def test_the_engine_runs_on_the_machines_gpu_unless_a_device_is_given(loaded, monkeypatch):
    """A command on a GPU machine trained on the CPU unless told ``engine.device=cuda`` (users of the Hugging
    Face Trainer and TRL expect the GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build(loaded).engine.device == "cuda"
    assert build(loaded, "engine.device=cpu").engine.device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build(loaded).engine.device == "cpu"


def test_engine_section_is_the_backends_class_with_the_commands_defaults(loaded):
    config = build(loaded, "engine.knob=5")
    assert type(config.engine) is ToyBackendConfig
    assert (config.engine.knob, config.engine.micro_batch.max_tokens) == (5, 64)
    # Setting one micro-batch limit clears the other (they are exclusive).
    assert build(loaded, "engine.micro_batch.micro_batch_size=2").engine.micro_batch == MicroBatchConfig(
        micro_batch_size=2, max_tokens=None
    )


def test_resolved_config_round_trips_through_yaml(loaded, tmp_path):
    config = build(loaded, "loop.steps=30", "loop.files=[x]")
    assert to_plain(config)["loop"] == {
        "steps": 30,
        "verbose": False,
        "files": ["x"],
        "warmup": 1,
        "length": "short",
    }
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(config))
    assert build_config(CommandConfig, [yaml.safe_load(path.read_text())], plugins=loaded) == config


def test_a_saved_config_reused_with_another_backend_follows_it_where_the_user_set_nothing(loaded):
    """A run's config.yaml holds every option of its backend; with engine.backend=<other> it failed on an
    option the user never wrote. Options at the written backend's defaults follow the new one."""

    def rebuilt(saved: dict[str, Any]) -> Any:
        layers = [saved, parse_override("engine.backend=dial")]
        return build_config(CommandConfig, layers, plugins=loaded, file_layers=1)

    saved = to_plain(build(loaded, "loop.steps=30"))
    assert (saved["engine"]["knob"], saved["engine"]["seed"]) == (3, 0)
    engine = rebuilt(saved).engine
    assert isinstance(engine, DialBackendConfig)
    assert (engine.dial, engine.seed, engine.micro_batch.max_tokens) == (5, 7, 64)

    engine = rebuilt(to_plain(build(loaded, "engine.seed=3"))).engine
    assert engine.seed == 3  # set away from the default by the user: kept

    with pytest.raises(
        ConfigError, match=r"written for backend toy and sets engine.knob=9, which backend dial"
    ):
        rebuilt(to_plain(build(loaded, "engine.knob=9")))


def test_field_reference_lists_type_default_and_help(loaded):
    fields = {f.name: f for f in describe_fields(build(loaded))}
    assert fields["loop.files"].type == "tuple[str, ...]" and fields["loop.files"].default == ()
    assert fields["loop.warmup"].help == "warm-up steps."
    assert fields["engine.knob"].help == "a backend-only setting."
    assert fields["engine.micro_batch.max_tokens"].help == "token budget per micro-batch (dynamic batching)."


def test_click_options_print_and_describe_the_config(tmp_path):
    @click.command()
    @config_options(LoopConfig)
    def command(config_file, overrides):
        click.echo(f"ran {load_config(LoopConfig, config_file, overrides).steps}")

    runner = CliRunner()
    assert runner.invoke(command, ["steps=4"]).output == "ran 4\n"
    printed = runner.invoke(command, ["--print-config", "steps=4"]).output
    assert yaml.safe_load(printed) == {
        "steps": 4,
        "verbose": False,
        "files": [],
        "warmup": 1,
        "length": "short",
    }
    described = runner.invoke(command, ["--help-config"]).output
    assert "steps: int = 10\n    optimizer steps." in described
    assert "files: tuple[str, ...] = []" in described


def test_print_config_names_the_preset_file_or_command_line_beside_each_value_they_set(tmp_path):
    """Where each value comes from, in a comment on its line: the preset ``loop.length=long`` picked (under the
    user's values), the file, the command line; the command's own defaults carry none. The text loads back."""

    @click.command()
    @config_options(SectionsConfig)
    def command(config_file, overrides):
        raise AssertionError("--print-config runs nothing")

    config_file = tmp_path / "run.yaml"
    config_file.write_text("loop:\n  length: long\n  files: [a.jsonl]\n")
    printed = (
        CliRunner().invoke(command, ["--print-config", "--config", str(config_file), "loop.warmup=7"]).output
    )
    assert printed.rstrip() == (
        "schedule:\n"
        "  decay_steps: 49  # preset long\n"
        "loop:\n"
        "  steps: 50  # preset long\n"
        "  verbose: false\n"
        "  files:  # --config\n"
        "  - a.jsonl\n"
        "  warmup: 7  # command line\n"
        "  length: long  # --config"
    )
    assert build_config(SectionsConfig, [yaml.safe_load(printed)]) == build_config(
        SectionsConfig, [{"loop": {"length": "long", "files": ["a.jsonl"], "warmup": 7}}]
    )


@dataclass(kw_only=True, frozen=True)
class DerivingConfig:
    """A command written against drivetrain-roles 0.5.0: a value computed from another by ``derived_values``.

    Attributes:
        loop: the loop.
    """

    loop: LoopConfig = field(default_factory=LoopConfig)

    @staticmethod
    def derived_values(config: Any) -> dict[str, Any]:
        return {"loop": {"warmup": config.loop.steps // 10}}


def test_a_command_still_declaring_derived_values_is_refused_naming_presets():
    """Removed in 0.7.0 as announced: read no more, it would leave its values silently unfollowed."""
    with pytest.raises(ConfigError, match=r"DerivingConfig.derived_values is no longer read .* PresetChoice"):
        build_config(DerivingConfig, [parse_override("loop.steps=50")])
