"""``export_weights`` one weight at a time, as groups of this rank's local shards (the ``sharded_export`` capability).

Each weight of the model is one :class:`ShardedWeight`: what this rank holds of it (its tensor-parallel slice;
under expert parallelism its copy of a local expert; nothing on a pipeline stage without the layer) and the
collective that gathers its Hugging Face tensors. A delta stream gathers only the weights whose local shards
changed on some rank (core's ``handoff.local_shards``, as verl's ``get_per_tensor_param_shard``);
:func:`export_hf_weights` gathers every one. Under expert parallelism a group is one local expert index on every
expert rank (each rank's copy is another global expert), so a changed expert gathers its peers too; only the
changed ones are sent.

A gather is the body of mbridge's ``Bridge.export_weights`` loop for one weight: broadcast from the pipeline stage
that holds it, all-gathered over the expert ranks and the tensor ranks, merged (``_weight_merge_across_tp``) and
renamed (``_weight_to_hf_format``). That loop exchanged each tensor's name and spec between the stages first
(three object collectives per tensor); here the stages exchange every name and spec once. (It also exported
routers' ``expert_bias`` buffers, which no model this backend builds has: ``moe.VERIFIED_MOE_TYPES``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from drivetrain_engine_core.backend import ShardedWeight
from drivetrain_engine_core.kit import distributed
from mbridge.core.bridge import Bridge
from torch import nn


@dataclass(frozen=True)
class _Spec:
    """A weight as every pipeline stage knows it: enough for a stage without it to receive it."""

    stage: int
    name: str  # megatron's global name (layer numbers over all stages; a local expert's local index)
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor_model_parallel: bool
    partition_dim: int | None


def export_hf_weights(bridge: Bridge, chunks: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every weight, gathered over tensor and pipeline ranks (collective).

    Each name once: with tied embeddings over several pipeline stages the last stage's copy of the embedding
    (its output layer) maps to the embedding's name too, and is skipped (:func:`export_weight_shards`).
    """
    for weight in export_weight_shards(bridge, chunks):
        yield from weight.gather()


def export_weight_shards(bridge: Bridge, chunks: list[nn.Module]) -> Iterator[ShardedWeight]:
    """What :func:`export_hf_weights` yields, as one group per weight of the model in mbridge's export order
    (stage by stage, chunk by chunk), keyed by its megatron global name. Collective: the stages exchange their
    weights' names and specs once; nothing is gathered until a group's ``gather`` is called."""
    held = _held_weights(bridge, chunks)
    device = next(iter(held.values())).device
    exported: set[str] = set()
    for spec in _every_stage(bridge, held):
        hf_names = set(bridge._weight_name_mapping_mcore_to_hf(spec.name))
        if hf_names <= exported:
            # NOTE: the last stage's copy of a tied embedding: sent once (a hand-off sent the largest tensor
            # twice), and never gathered.
            continue
        exported |= hf_names
        tensor = held[spec.name] if spec.stage == bridge.mpu.pp_rank else None
        local = () if tensor is None else (tensor.detach(),)
        yield ShardedWeight(key=spec.name, local=local, gather=partial(_gather, bridge, spec, tensor, device))


def _held_weights(bridge: Bridge, chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters under their megatron global names, chunk by chunk (what mbridge exports)."""
    held: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        global_names = bridge._weight_name_mapping_mcore_local_to_global(chunk, consider_ep=False)
        held.update((global_names[name], param) for name, param in chunk.named_parameters())
    return held


def _every_stage(bridge: Bridge, held: dict[str, torch.Tensor]) -> list[_Spec]:
    """The weights of every pipeline stage in stage order (one exchange over the pipeline group)."""
    mine = [
        _Spec(
            stage=bridge.mpu.pp_rank,
            name=name,
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            tensor_model_parallel=bool(getattr(tensor, "tensor_model_parallel", False)),
            partition_dim=getattr(tensor, "partition_dim", None),
        )
        for name, tensor in held.items()
    ]
    if bridge.mpu.pp_size == 1:
        return mine
    stages = cast(list[list[_Spec]], distributed.all_gather_objects(mine, group=bridge.mpu.pp_group))
    return [spec for stage in stages for spec in stage]


def _gather(
    bridge: Bridge, spec: _Spec, tensor: torch.Tensor | None, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one weight, copies of the parameters (collective over the pipeline, expert
    and tensor ranks). NOTE: ``no_grad`` inside this call only, never across a consumer's iteration: grad mode is
    thread state, and a generator suspended inside ``no_grad`` and closed late restored the mode it saw."""
    with torch.no_grad():
        whole = _from_stage(bridge, spec, tensor, device)
        expert = ".mlp.experts.linear_fc" in spec.name and bridge.mpu.ep_size > 1
        pieces = _expert_copies(bridge, spec.name, whole) if expert else [(spec.name, whole)]
        tensors = []
        for name, piece in pieces:
            names, converted = bridge._weight_to_hf_format(
                name, _merged_over_tp(bridge, name, piece, whole, expert)
            )
            tensors += [
                (hf_name, weight.detach().clone()) for hf_name, weight in zip(names, converted, strict=True)
            ]
        return tensors


def _from_stage(
    bridge: Bridge, spec: _Spec, tensor: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The weight on this rank: broadcast over the pipeline group from the stage that holds it."""
    if bridge.mpu.pp_size == 1:
        assert tensor is not None  # one stage holds every weight
        return tensor
    if tensor is None:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        tensor.tensor_model_parallel = spec.tensor_model_parallel  # type: ignore[attr-defined]
        tensor.partition_dim = spec.partition_dim  # type: ignore[attr-defined]
    group = bridge.mpu.pp_group
    dist.broadcast(tensor, src=dist.get_global_rank(group, spec.stage), group=group)
    return tensor


def _expert_copies(bridge: Bridge, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Every expert rank's copy of a local expert, under its global expert's name."""
    mpu = bridge.mpu
    prefix, local_index = name.split(".weight")
    per_rank = bridge.config.num_moe_experts // mpu.ep_size
    copies = _all_gathered(tensor, mpu.ep_size, mpu.ep_group)
    return [
        (f"{prefix}.weight{rank * per_rank + int(local_index)}", copy) for rank, copy in enumerate(copies)
    ]


def _merged_over_tp(
    bridge: Bridge, name: str, tensor: torch.Tensor, like: torch.Tensor, expert: bool
) -> torch.Tensor:
    """``tensor`` whole: its slices of every (expert) tensor rank merged in megatron's layout (``like`` carries
    the parameter's partition attributes); a weight that is not split over the tensor ranks as it is."""
    mpu = bridge.mpu
    if expert:
        size, group = mpu.etp_size, mpu.etp_group
    elif getattr(like, "tensor_model_parallel", False):
        size, group = mpu.tp_size, mpu.tp_group
    else:
        return tensor
    slices = [tensor] if size <= 1 else _all_gathered(tensor, size, group)
    return bridge._weight_merge_across_tp(name, slices, like)


def _all_gathered(tensor: torch.Tensor, size: int, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of ``group`` (of ``size`` ranks), in rank order."""
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered
