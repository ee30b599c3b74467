"""The generated config reference pages of the commands (``docs/<command>-config.md``), from the dataclasses."""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.job import leaves

from ..runtime.command_config import PresetChoice, describe_fields, format_reference

HEADER = """# `drivetrain {command}` config reference

Generated from the config dataclasses by `drivetrain_roles.jobs.config_reference.reference_page({command!r})` (a test
keeps this page equal to it); `drivetrain {command} --help-config [engine.backend=...]` prints the same for any
installed backend. Each entry: `section.field: type = default`, then its help. Set values in a YAML file
(`--config`, see `drivetrain_roles/{package}/example.yaml`) or as `section.field=value` overrides;
`--print-config` prints a run's resolved config.
"""

PRESETS = """
## Presets

Named values the command lays over the defaults above and under your `--config` file and overrides (a value you
set wins); `--print-config` names the preset beside each value it gives (`# preset user-model`).
"""

PACKAGES = {"sft": "sft", "dpo": "dpo", "rm": "rm", "grpo": "grpo", "ppo": "ppo"}


def reference_page(command: str = "sft") -> str:
    """The Markdown page of ``command``: the header, every field of its default config (FSDP engine), then the
    presets it may pick."""
    config: Any = _load_config(command)()
    header = HEADER.format(command=command, package=PACKAGES[command])
    page = f"{header}\n```text\n{format_reference(describe_fields(config))}\n```\n"
    choices: tuple[PresetChoice, ...] = getattr(type(config), "presets", ())
    items = [line for choice in choices for line in _preset_items(choice)]
    return page + PRESETS + "\n" + "\n".join(items) + "\n" if items else page


def _preset_items(choice: PresetChoice) -> list[str]:
    """One list item per preset of ``choice`` that sets anything: its name, what picks it, its values."""
    values: dict[str, list[str]] = {}  # preset name -> the values of choice.key that pick it
    for value, preset in choice.presets.items():
        values.setdefault(preset.name, []).append(f"`{choice.key}={value}`")
    named = {preset.name: preset for preset in choice.presets.values()}
    picked = [(named[name], " or ".join(given)) for name, given in values.items()]
    if choice.otherwise is not None:
        picked.append((choice.otherwise, f"any other `{choice.key}`"))
    return [
        f"- `{preset.name}` ({when}): "
        + ", ".join(f"`{key}={value}`" for key, value in leaves(preset.values))
        for preset, when in picked
        if preset.values
    ]


def _load_config(command: str) -> Any:
    import importlib

    return importlib.import_module(f"drivetrain_roles.{PACKAGES[command]}.config").load_config
