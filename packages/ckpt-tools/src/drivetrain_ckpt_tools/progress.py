"""A merge's progress on the console: the step's weights written of its total, shown only on a terminal.

A merge reads and writes a model's weights one tensor at a time: seconds for a small model, minutes for a large
one, with nothing printed until it ends. ``tqdm`` (a dependency of transformers) draws the bar on stderr; where
stderr is not a terminal (a log file, a pipe) it stays quiet.
"""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.backend import CheckpointMerger
from drivetrain_engine_core.kit import split_peft_name


def base_tensor_count(merger: CheckpointMerger) -> int:
    """How many stored tensors a full-model merge reads: every one, or a LoRA step's base and saved ones."""
    names = merger.tensor_names()
    if not merger.is_lora:
        return len(names)
    return sum(split_peft_name(name)[0] in ("base", "saved") for name in names)


def merge_progress(total: int, *, enabled: bool) -> Any:
    """A bar of ``total`` tensors labelled ``merge``; hidden unless ``enabled`` and stderr is a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="merge", unit="tensor", disable=None if enabled else True)


__all__ = ["base_tensor_count", "merge_progress"]
