"""Give a model sharded on ``meta`` its values: allocate only this rank's shards, then fill them.

``to_empty`` is FSDP2's documented way out of ``meta``: each sharded parameter gets storage for its local shard
only. The shards are then filled from three places: the checkpoint (``hf_weights.load_checkpoint_shards``, each
rank reading its own slices; a fused MoE expert weight is read whole, one at a time, and joined by transformers'
conversion before each rank keeps its slice), the engine's own initial values (value head, LoRA adapters: small, full on every
rank, of which each rank keeps its slice), and the buffers (rotary ``inv_freq``), which are not sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .conversion import FusedWeight, fuse
from .export import hf_name
from .hf_weights import load_checkpoint_shards
from .meta_build import MetaModel
from .shards import local_shard


@torch.no_grad()
def materialize(module: nn.Module, built: MetaModel, device: str) -> None:
    """Allocate ``module``'s local shards on ``device`` and fill them (a collective on every rank).

    Args:
        module: ``built.module`` after ``fully_shard``.
        built: what :func:`~drivetrain_engine_fsdp.meta_build.build_meta_model` returned with it.
        device: where the shards live (the compute device, or CPU under FSDP2's CPU offload policy).
    """
    module.to_empty(device=device)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, value in built.buffers.items():
        tensors[name].copy_(value)
    for name, value in built.initial.items():
        local_shard(tensors[name]).copy_(_local_slice(value.to(device), tensors[name]))
    copies: dict[str, list[str]] = {}
    for name, checkpoint_name in built.checkpoint_names.items():
        copies.setdefault(checkpoint_name, []).append(name)
    load_checkpoint_shards(built.index, {key: tensors[names[0]].detach() for key, names in copies.items()})
    for names in copies.values():
        # A PEFT module-to-save keeps two copies of one weight (``original_module`` and the trained one).
        for name in names[1:]:
            local_shard(tensors[name]).copy_(local_shard(tensors[names[0]]))
    for name, fused in built.fused.items():
        full = _read_fused(built, name, fused, tensors[name].dtype)
        local_shard(tensors[name]).copy_(_local_slice(full.to(device), tensors[name]))


def _read_fused(built: MetaModel, name: str, fused: FusedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The full weight ``name`` joined from its checkpoint pieces, read on every rank (a collective).

    NOTE: each piece is read whole (no rank-local slicing): a fused weight's shard does not map onto slices of
    the pieces in general (``gate_up_proj`` concatenates two of them). Peak memory is one fused weight.
    """
    pieces = {key: torch.empty(built.index.shapes[key], dtype=dtype) for key, _ in fused.sources}
    load_checkpoint_shards(built.index, pieces)
    hf = hf_name(name)
    assert hf is not None  # adapters are never fused
    return fuse(built.hf_model, hf, fused, pieces)


def _local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` when laid out as ``like`` (every rank holds the same ``full``)."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
