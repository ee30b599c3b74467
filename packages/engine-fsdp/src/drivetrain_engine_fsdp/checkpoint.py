"""Model and optimizer checkpoints with torch.distributed.checkpoint (DCP), reshardable across world sizes.

Key convention (read by ``merger.py`` and ckpt-tools): ``model/`` holds exactly the keys of
``get_model_state_dict(model)``: the plain Hugging Face state-dict names of the wrapped model (for a PEFT model
with its ``base_model.model.`` prefix, ``...base_layer.weight`` and ``...lora_A.default.weight``), each a
full-shape tensor in DCP's metadata whatever the number of writing ranks. ``optimizer/`` holds
``get_optimizer_state_dict(model, optimizer)`` (state keyed by the same parameter names).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core.backend import MODEL_DIR, OPTIMIZER_DIR, check_saved_shapes
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def save_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, step_dir: Path) -> None:
    """Write ``model/`` (and ``optimizer/`` when given) under ``step_dir``; a collective on every rank."""
    dcp.save(get_model_state_dict(module), checkpoint_id=step_dir / MODEL_DIR)
    if optimizer is not None:
        dcp.save(get_optimizer_state_dict(module, optimizer), checkpoint_id=step_dir / OPTIMIZER_DIR)


def load_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, step_dir: Path) -> None:
    """Read what :func:`save_state` wrote, resharding to this run's layout; a collective on every rank (core
    has checked that a step read with ``optimizer`` holds optimizer state)."""
    model_state = get_model_state_dict(module)
    shapes = {k: v.shape for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    check_saved_shapes(step_dir, step_dir / MODEL_DIR, shapes)
    dcp.load(model_state, checkpoint_id=step_dir / MODEL_DIR)
    set_model_state_dict(module, model_state)
    if optimizer is None:
        return
    optimizer_state = get_optimizer_state_dict(module, optimizer)
    dcp.load(optimizer_state, checkpoint_id=step_dir / OPTIMIZER_DIR)
    set_optimizer_state_dict(module, optimizer, optimizer_state)
