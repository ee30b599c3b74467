"""drivetrain-ckpt-tools: merge drivetrain checkpoint steps into Hugging Face directories, and verify them.

The public names are imported lazily: the ``drivetrain`` entry point loads ``drivetrain_ckpt_tools.plugin``,
which imports this package first, and listing plugins must not pull in torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MergeOptions": "merge",
    "MergeResult": "merge",
    "merge_checkpoint": "merge",
    "StepInfo": "inspect",
    "list_steps": "inspect",
    "VerifyResult": "verify",
    "verify_merged": "verify",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = sorted(_EXPORTS)
