"""Device meshes and FSDP2 sharding: one ``fully_shard`` unit per decoder layer plus the root.

Two views of the same ranks are built. The FSDP mesh shards parameters over every rank (1-D), or shards inside
groups of ``fsdp_size`` and replicates across them (2-D, hybrid). The data/sequence-parallel mesh
``(dp, sp)`` says which ranks see the same sequences (the ``sp`` ranks of one Ulysses group) and which see
different ones (``dp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from .config import FSDPEngineConfig
from .model import decoder_layers


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: its FSDP mesh and its data- and sequence-parallel groups.

    Attributes:
        fsdp_mesh: the mesh parameters are sharded over (1-D, or 2-D ``(replicate, shard)`` when hybrid).
        dp_group: ranks that see different sequences (``None`` means the whole world).
        sp_group: the Ulysses group of this rank (``None`` without sequence parallelism).
        dp_rank, dp_size, sp_rank, sp_size: positions and sizes in those groups.
    """

    fsdp_mesh: DeviceMesh
    dp_group: dist.ProcessGroup | None
    sp_group: dist.ProcessGroup | None
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int


def build_layout(config: FSDPEngineConfig) -> ParallelLayout:
    """Create the meshes and groups of ``config`` on the launched world (a collective on every rank).

    Raises:
        ConfigError: the parallel sizes do not divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    config.check_world(world)
    fsdp_size = config.resolved_fsdp_size(world)
    if fsdp_size == world:
        fsdp_mesh = init_device_mesh(config.device, (world,), mesh_dim_names=("shard",))
    else:
        fsdp_mesh = init_device_mesh(
            config.device, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard")
        )
    sp = config.ulysses_sequence_parallel_size
    if sp == 1:
        return ParallelLayout(
            fsdp_mesh=fsdp_mesh,
            dp_group=None,
            sp_group=None,
            dp_rank=rank,
            dp_size=world,
            sp_rank=0,
            sp_size=1,
        )
    dp_sp = init_device_mesh(config.device, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return ParallelLayout(
        fsdp_mesh=fsdp_mesh,
        dp_group=dp_sp["dp"].get_group(),
        sp_group=dp_sp["sp"].get_group(),
        dp_rank=rank // sp,
        dp_size=world // sp,
        sp_rank=rank % sp,
        sp_size=sp,
    )


def shard_model(model: nn.Module, layout: ParallelLayout, config: FSDPEngineConfig) -> nn.Module:
    """Apply ``fully_shard`` per decoder layer, then to the root (which holds embeddings, norm and head).

    ``reshard_after_forward`` applies to the decoder layers; the root keeps its parameters gathered.

    Parameters move to the mesh's device as they are sharded, or stay on CPU under ``cpu_offload_policy``. With
    ``compile_layers`` each decoder layer is compiled first.
    """
    mixed_precision = MixedPrecisionPolicy(
        param_dtype=getattr(torch, config.param_dtype),
        reduce_dtype=getattr(torch, config.reduce_dtype),
    )
    kwargs: dict = {"mesh": layout.fsdp_mesh, "mp_policy": mixed_precision}
    if config.cpu_offload_policy:
        # Pinned host memory only helps (and only works) with an accelerator to copy to.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=config.device != "cpu")
    for layer in decoder_layers(model):
        if config.compile_layers:
            # NOTE: compiled in place (``Module.compile``) so parameter names and checkpoints do not change, and
            # before fully_shard as torchtitan does: FSDP2's hooks stay outside the graph, which then holds only
            # the layer's own compute and is reused by every layer of the same structure.
            layer.compile()
        fully_shard(layer, reshard_after_forward=config.reshard_after_forward, **kwargs)
    # The root's parameters (embeddings, final norm, head) are the first that backward needs, so freeing them
    # after forward would only buy an immediate second all-gather.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model
