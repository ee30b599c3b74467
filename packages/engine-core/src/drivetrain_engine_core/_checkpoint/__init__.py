"""The on-disk checkpoint layout shared by every backend and by ckpt-tools (ARCHITECTURE §5).

Importing the package is cheap: the layout, manifests and publishing load eagerly; the tensor readers and the
merger base (which need torch) on first attribute access, so that ``drivetrain ckpt ls`` lists steps without
importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr
from .layout import (
    LATEST_FILE,
    MODEL_DIR,
    OPTIMIZER_DIR,
    StepEntry,
    complete_steps,
    prepare_temporary_step_dir,
    read_latest,
    resolve_step_dir,
    step_dir_name,
    step_entries,
    temporary_step_dir,
)
from .manifest import MANIFEST_FILE, Manifest, read_manifest, verify_files, write_manifest
from .peft import PEFT_PREFIX, peft_adapter_config, split_peft_name
from .points import PUBLISH_POINTS, set_fault_hook
from .publish import prune_old_steps, publish_step

if TYPE_CHECKING:
    from .dcp_reader import DCPTensorReader, check_saved_shapes
    from .merger import AUTO_CLASSES, CheckpointMerger

_LAZY = {
    "AUTO_CLASSES": "merger",
    "CheckpointMerger": "merger",
    "DCPTensorReader": "dcp_reader",
    "check_saved_shapes": "dcp_reader",
}

__all__ = [
    "AUTO_CLASSES",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MODEL_DIR",
    "OPTIMIZER_DIR",
    "PEFT_PREFIX",
    "PUBLISH_POINTS",
    "CheckpointMerger",
    "DCPTensorReader",
    "Manifest",
    "StepEntry",
    "check_saved_shapes",
    "complete_steps",
    "peft_adapter_config",
    "prepare_temporary_step_dir",
    "prune_old_steps",
    "publish_step",
    "read_latest",
    "read_manifest",
    "resolve_step_dir",
    "set_fault_hook",
    "split_peft_name",
    "step_dir_name",
    "step_entries",
    "temporary_step_dir",
    "verify_files",
    "write_manifest",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
