"""Checkpoint layout and module layout of a Hugging Face model: transformers' own weight conversions.

transformers 5 builds some modules with weights in another layout than their checkpoints hold: a Qwen3-MoE,
Qwen2-MoE or Mixtral layer keeps its experts fused (``mlp.experts.gate_up_proj``, ``[experts, 2 * intermediate,
hidden]``), while the checkpoint holds one tensor per expert and projection (``mlp.experts.N.gate_proj.weight``).
``from_pretrained`` converts on load and ``save_pretrained`` converts back on save, both by the conversion mapping
transformers registers for the model (``transformers.conversion_mapping``). The meta-device loader and the export
use that same mapping through the same library calls (name matching, ``WeightConverter.convert``,
``revert_weight_conversion``), so drivetrain keeps no table of its own and a model transformers learns to
convert is converted here too. Stacking and concatenating copy values: both directions are exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)


@dataclass(frozen=True)
class FusedWeight:
    """A module weight that the checkpoint holds as several tensors (experts fused into one).

    Attributes:
        sources: ``(checkpoint name, converter source pattern)`` of each piece, in transformers' loading order.
        converter: the registered converter that joins the pieces (a fresh copy is used for each join).
    """

    sources: tuple[tuple[str, str], ...]
    converter: WeightConverter


def base_model(module: Any) -> Any:
    """The transformers model inside a (possibly PEFT-wrapped) module: the one conversions are registered for."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def checkpoint_layout(model: Any, state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Module name -> (checkpoint name -> shape) of what ``save_pretrained`` writes for each weight of ``state``
    (``model``'s weights, on ``meta`` or not): one entry for a weight stored as it is or renamed (Mixtral's
    ``block_sparse_moe``), one per piece for a fused weight."""
    return {
        name: {key: tuple(piece.shape) for key, piece in unfuse(model, name, tensor).items()}
        for name, tensor in state.items()
    }


def fused_weights(model: Any, checkpoint_names: Iterable[str]) -> dict[str, FusedWeight]:
    """Module name -> :class:`FusedWeight` of every weight of ``model`` that ``checkpoint_names`` holds in pieces.

    The names are matched as ``from_pretrained`` matches them: renamings, then at most one converter, in the
    checkpoint's natural key order (``experts.2`` before ``experts.10``), which is the order the pieces stack in.
    """
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    if not converters:
        return {}
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    module_state = model.state_dict()
    pieces: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(checkpoint_names, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, module_state)
        if pattern is not None and name in module_state:
            pieces.setdefault(name, []).append((key, pattern))
    return {
        name: FusedWeight(sources=tuple(sources), converter=by_pattern[sources[0][1]])
        for name, sources in pieces.items()
    }


def fuse(model: Any, name: str, fused: FusedWeight, pieces: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The module weight ``name`` joined from its checkpoint ``pieces`` (checkpoint name -> full tensor)."""
    converter = deepcopy(fused.converter)
    for key, pattern in fused.sources:
        # transformers annotates a Future; materialize_tensors also takes tensors (its saving path passes them).
        converter.add_tensor(name, key, pattern, pieces[key])  # type: ignore[arg-type]
    return converter.convert(name, model=model, config=model.config)[name]


def unfuse(model: Any, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor of the module weight ``name`` as ``save_pretrained`` writes it (itself, under
    its own name, when no conversion applies)."""
    return revert_weight_conversion(model, {name: tensor})
