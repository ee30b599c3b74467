"""Reading the distributed optimizer's layout record (:mod:`.dist_opt_layout` writes it) without megatron.

The record (``optimizer_layout/rank<N>-<i>.json``) places every model tensor's Adam moments in the flat bucket
tensors of a ``dp_reshardable`` optimizer checkpoint. Reading it needs only JSON and the step's torch
distributed checkpoint, so the merger, ``drivetrain ckpt ls`` and another backend's resume do not import
megatron-core.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from drivetrain_engine_core.kit import DCPTensorReader

LAYOUT_DIR = "optimizer_layout"


def has_layout(step_dir: Path) -> bool:
    """Whether ``step_dir`` holds the record :func:`.dist_opt_layout.write_layout` writes (steps saved before it
    do not)."""
    return any((step_dir / LAYOUT_DIR).glob("*.json"))


def read_adam_step(step_dir: Path) -> int:
    """The AdamW step the record's optimizers had taken (megatron pickles it inside its own state object,
    which an offline reader would have to unpickle; the record keeps it as a number)."""
    return max((record["adam_step"] for record in _records(step_dir)), default=0)


def read_moments(step_dir: Path, reader: DCPTensorReader, moment: str) -> dict[str, torch.Tensor]:
    """Full ``moment`` tensors keyed by ``model/``'s checkpoint keys, cut out of the flat bucket tensors.

    Args:
        step_dir: a step with an ``optimizer_layout/`` record.
        reader: the step's ``optimizer/`` directory.
        moment: ``"exp_avg"`` or ``"exp_avg_sq"``.
    """
    import torch  # here, not with the module: ``drivetrain ckpt ls`` reads the record without torch

    buckets: dict[str, torch.Tensor] = {}
    moments: dict[str, torch.Tensor] = {}
    for record in _records(step_dir):
        for entry in record["pieces"]:
            name = f"{entry['bucket']}.{moment}"
            if name not in buckets:
                buckets[name] = reader.read(name)
            flat = buckets[name]
            full = moments.setdefault(entry["key"], torch.zeros(entry["global_shape"], dtype=flat.dtype))
            shape = entry["shape"]
            start = entry["start"]
            region = tuple(
                slice(offset, offset + size) for offset, size in zip(entry["offset"], shape, strict=True)
            )
            full[region] = flat[start : start + math.prod(shape)].view(shape)
    return moments


def _records(step_dir: Path) -> Iterator[dict[str, Any]]:
    for path in sorted((step_dir / LAYOUT_DIR).glob("*.json")):
        yield json.loads(path.read_text())
