"""One config layer for every ``drivetrain`` command: YAML file + dotted overrides -> typed frozen dataclasses.

Built by core's one config builder (:func:`drivetrain_engine_core.job.build_layers`, on OmegaConf structured
configs, what Hydra and verl users already write): OmegaConf checks every value against its annotation and
merges the layers. This layer adds the user's layers (the file, the overrides), engine sections typed by the
chosen backend's own config class, presets (named values picked by ``model.path`` or ``trainer.mode`` and laid
under the user's layers, named in ``--print-config``), TRL's and verl's names pointing at the field to write,
and the ``--config`` / ``--print-config`` / ``--help-config`` options.

```python
from drivetrain_roles.runtime.command_config import load_config, to_yaml

config = load_config(MyCommandConfig, "run.yaml", ["trainer.total_steps=100"])
print(to_yaml(config))
```
"""

from __future__ import annotations

from drivetrain_engine_core.job import check_keys

from .build import build_config, value_sources
from .layers import parse_override, read_yaml
from .load import load_config, load_sources
from .options import config_options
from .presets import Preset, PresetChoice
from .render import FieldInfo, describe_fields, format_reference, to_plain, to_yaml

__all__ = [
    "FieldInfo",
    "Preset",
    "PresetChoice",
    "build_config",
    "check_keys",
    "config_options",
    "describe_fields",
    "format_reference",
    "load_config",
    "load_sources",
    "parse_override",
    "read_yaml",
    "to_plain",
    "to_yaml",
    "value_sources",
]
