"""The generated config reference pages of the commands (``docs/<command>-config.md``), from the dataclasses."""

from __future__ import annotations

from typing import Any

from ..runtime.command_config import describe_fields, format_reference

HEADER = """# `drivetrain {command}` config reference

Generated from the config dataclasses by `drivetrain_roles.jobs.config_reference.reference_page({command!r})` (a test
keeps this page equal to it); `drivetrain {command} --help-config [engine.backend=...]` prints the same for any
installed backend. Each entry: `section.field: type = default`, then its help. Set values in a YAML file
(`--config`, see `drivetrain_roles/{package}/example.yaml`) or as `section.field=value` overrides;
`--print-config` prints a run's resolved config.
"""

PACKAGES = {"sft": "sft", "dpo": "dpo", "rm": "rm", "grpo": "grpo", "ppo": "ppo"}


def reference_page(command: str = "sft") -> str:
    """The Markdown page of ``command``: the header, then every field of its default config (FSDP engine)."""
    config: Any = _load_config(command)()
    header = HEADER.format(command=command, package=PACKAGES[command])
    return f"{header}\n```text\n{format_reference(describe_fields(config))}\n```\n"


def _load_config(command: str) -> Any:
    import importlib

    return importlib.import_module(f"drivetrain_roles.{PACKAGES[command]}.config").load_config
