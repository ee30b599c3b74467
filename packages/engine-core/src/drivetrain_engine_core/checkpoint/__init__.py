"""The on-disk checkpoint layout shared by every backend and by ckpt-tools (ARCHITECTURE §5)."""

from .dcp_reader import DCPTensorReader
from .layout import (
    LATEST_FILE,
    complete_steps,
    prepare_temporary_step_dir,
    prune_old_steps,
    publish_step,
    resolve_step_dir,
    step_dir_name,
    temporary_step_dir,
)
from .manifest import MANIFEST_FILE, Manifest, read_manifest, verify_files, write_manifest
from .merger import AUTO_CLASSES, CheckpointMerger
from .peft import PEFT_PREFIX, split_peft_name

__all__ = [
    "AUTO_CLASSES",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "PEFT_PREFIX",
    "CheckpointMerger",
    "DCPTensorReader",
    "Manifest",
    "complete_steps",
    "prepare_temporary_step_dir",
    "prune_old_steps",
    "publish_step",
    "read_manifest",
    "resolve_step_dir",
    "split_peft_name",
    "step_dir_name",
    "temporary_step_dir",
    "verify_files",
    "write_manifest",
]
