"""A rank's local shard of an FSDP2 tensor, and a local tensor wrapped back as a shard of the same layout."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (its storage, not a copy); a plain tensor is its own."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_like(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``like``'s kind: a DTensor on the same mesh and placements, or plain."""
    if not isinstance(like, DTensor):
        return local
    # NOTE: not ``DTensor.from_local``: it moves ``local`` to the mesh's device type, so a host buffer on a
    # CUDA mesh went straight back to the GPU (the offload freed nothing and cost two copies). Wrapped in
    # place, as FSDP2 wraps its own CPU-offloaded parameters; shape, stride, mesh and placements are ``like``'s.
    return DTensor(local, like._spec, requires_grad=False)
