"""drivetrain-ckpt-tools: merge drivetrain checkpoint steps into Hugging Face directories, and verify them.

The public names are imported lazily: the ``drivetrain`` entry point loads ``drivetrain_ckpt_tools.plugin``,
which imports this package first, and listing plugins must not pull in torch or transformers.
"""

from __future__ import annotations

from drivetrain_engine_core.kit import lazy_getattr

_EXPORTS = {
    "MergeOptions": "merge",
    "MergeResult": "merge",
    "merge_checkpoint": "merge",
    "StepInfo": "inspect",
    "list_steps": "inspect",
    "VerifyResult": "verify",
    "verify_merged": "verify",
}


__getattr__ = lazy_getattr(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
