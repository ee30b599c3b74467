"""The generated reference page of ``drivetrain sft``'s config (``docs/sft-config.md``), from the dataclasses."""

from __future__ import annotations

from drivetrain_engine_core.command_config import describe_fields, format_reference

from .config import load_config

HEADER = """# `drivetrain sft` config reference

Generated from the config dataclasses by `drivetrain_roles.sft.reference.reference_page()` (a test keeps this
page equal to it); `drivetrain sft --help-config [engine.backend=...]` prints the same for any installed
backend. Each entry: `section.field: type = default`, then its help. Set values in a YAML file
(`--config`, see `drivetrain_roles/sft/example.yaml`) or as `section.field=value` overrides;
`--print-config` prints a run's resolved config.
"""


def reference_page() -> str:
    """The Markdown page: the header, then every field of the default config (FSDP engine section)."""
    return f"{HEADER}\n```text\n{format_reference(describe_fields(load_config()))}\n```\n"
