"""Model and optimizer checkpoints with torch.distributed.checkpoint (DCP), reshardable across world sizes.

Key convention (read by ``merger.py`` and ckpt-tools): ``model/`` holds exactly the keys of
``get_model_state_dict(model)``: the plain Hugging Face state-dict names of the wrapped model (for a PEFT model
with its ``base_model.model.`` prefix, ``...base_layer.weight`` and ``...lora_A.default.weight``), each a
full-shape tensor in DCP's metadata whatever the number of writing ranks. ``optimizer/`` holds
``get_optimizer_state_dict(model, optimizer)`` (state keyed by the same parameter names).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from drivetrain_engine_core.kit import (
    ADAM_MOMENTS,
    MODEL_DIR,
    OPTIMIZER_DIR,
    WEIGHT,
    HFTrainingState,
    check_saved_shapes,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .conversion import base_model, checkpoint_layout, fuse, fused_weights


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


_FULL = StateDictOptions(full_state_dict=True)


def load_hf_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: HFTrainingState,
    *,
    tie_word_embeddings: bool,
) -> None:
    """Load another backend's (or layout's) step from its Hugging Face-named full state (collective).

    The model's state-dict names are Hugging Face names already, so the full tensors are handed to torch's
    ``set_model_state_dict`` / ``set_optimizer_state_dict``, which shard them onto this run's mesh (every rank
    keeps only its own shards). A tied output layer reads the embedding's tensors where the source stores them
    once (megatron, and every optimizer: one parameter, one state).
    """
    tied = {_LM_HEAD: _EMBEDDING} if tie_word_embeddings else {}
    shapes = {name: tuple(tensor.shape) for name, tensor in get_model_state_dict(module).items()}  # type: ignore[union-attr]
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    layout = checkpoint_layout(base_model(module), meta)
    state.check_fits({key: shape for pieces in layout.values() for key, shape in pieces.items()}, tied=tied)
    # The optimizer first: a step whose moments cannot move fails before any weight is changed.
    if optimizer is not None:
        optimizer_state: Any = get_optimizer_state_dict(module, optimizer, options=_FULL)
        names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
        step = float(state.adam_step())
        moments = {
            moment: _by_name(_module_layout(module, state.tensors(moment)), names, tied)
            for moment in ADAM_MOMENTS
        }
        optimizer_state["state"] = {
            name: {"step": torch.tensor(step), **{moment: moments[moment][name] for moment in ADAM_MOMENTS}}
            for name in names
        }
        set_optimizer_state_dict(module, optimizer, optimizer_state, options=_FULL)
        for moment in ADAM_MOMENTS:
            state.release(moment)
    weights: dict[str, Any] = _by_name(_module_layout(module, state.tensors(WEIGHT)), shapes, tied)
    set_model_state_dict(module, weights, options=_FULL)
    state.release(WEIGHT)


def _module_layout(module: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (Hugging Face checkpoint layout, as every merger yields them: one tensor per expert of a
    mixture-of-experts layer) with the pieces of each fused module weight joined as ``from_pretrained`` joins
    them (transformers' own conversion; stacking copies values, so weights and moments stay exact)."""
    model = base_model(module)
    joined = dict(tensors)
    for name, weight in fused_weights(model, tensors).items():
        joined[name] = fuse(model, name, weight, {key: joined.pop(key) for key, _ in weight.sources})
    return joined


def _by_name(
    tensors: dict[str, torch.Tensor], names: Iterable[str], tied: dict[str, str]
) -> dict[str, torch.Tensor]:
    """``tensors`` for each of ``names``, a tied name reading its source's where it has none of its own."""
    return {name: tensors[name] if name in tensors else tensors[tied[name]] for name in names}


_EMBEDDING = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"
