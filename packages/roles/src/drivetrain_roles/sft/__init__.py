"""The SFT trainer behind ``drivetrain sft``: config, data, embedded default job, loop, metrics, launch.

Names are imported lazily so that registering the ``sft`` command (which imports ``sft.command``) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataConfig": "config",
    "SFTConfig": "config",
    "TrainerConfig": "config",
    "load_config": "config",
    "DataError": "data",
    "SFTResult": "trainer",
    "SFTTrainer": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; it exports {__all__}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
