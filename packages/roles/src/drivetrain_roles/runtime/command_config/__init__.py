"""One config layer for every ``drivetrain`` command: YAML file + dotted overrides -> typed frozen dataclasses.

Built on OmegaConf structured configs (what Hydra and verl users already write): OmegaConf checks every
value against its annotation and merges the layers; drivetrain adds the unknown-key check with the close
match, engine sections typed by the chosen backend's own config class, derived values in one place, and
messages that name the field and the fix.

```python
from drivetrain_roles.runtime.command_config import load_config, to_yaml

config = load_config(MyCommandConfig, "run.yaml", ["trainer.total_steps=100"])
print(to_yaml(config))
```
"""

from __future__ import annotations

from drivetrain_engine_core.job import check_keys

from .build import Derive, build_config
from .layers import parse_override, read_yaml
from .load import load_config
from .options import config_options
from .render import FieldInfo, describe_fields, format_reference, to_plain, to_yaml

__all__ = [
    "Derive",
    "FieldInfo",
    "build_config",
    "check_keys",
    "config_options",
    "describe_fields",
    "format_reference",
    "load_config",
    "parse_override",
    "read_yaml",
    "to_plain",
    "to_yaml",
]
