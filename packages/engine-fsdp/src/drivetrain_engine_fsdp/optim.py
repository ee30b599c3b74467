"""The optimizer of the FSDP2 engine: AdamW over the trainable (sharded) parameters, and the global grad norm.

Both work on each rank's local shards, not on FSDP2's DTensors. NOTE: every DTensor operation pays DTensor's
sharding propagation, and for the optimizer's foreach kernels that propagation is not cached (their scalars
change from step to step): it was about a tenth of a tiny model's GRPO step on the CPU, at any world size.
AdamW is element-wise and the norm is a sum of squares, so the local shards give the same numbers with one
all-reduce of the norm (which DTensor runs too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from drivetrain_engine_core.backend import OptimizerConfig
from torch import nn
from torch.distributed.tensor import DTensor

from .shards import local_shard, sharded_like

NORM_TYPE = 2.0


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that receive gradients (all of them, or the adapters and value head under LoRA)."""
    return [p for p in module.parameters() if p.requires_grad]


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs on each parameter's local shard.

    Between steps the parameters and the moments are FSDP2's DTensors, as checkpoints and offload expect; for
    the step, the param groups and the state are swapped for views of the local shards (the same storage, so
    the update lands in the DTensors), AdamW's own step runs on them, and moments it creates on a first step
    are wrapped back as DTensors laid out as their parameter.
    """

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.no_grad(), self._local_views():
            return super().step(closure)

    @contextmanager
    def _local_views(self) -> Iterator[None]:
        groups = [group["params"] for group in self.param_groups]
        state = self.state
        views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.state = type(state)(dict)  # a defaultdict: AdamW fills a new parameter's entry itself
        try:
            for group in self.param_groups:
                group["params"] = [self._view(p, state, views) for p in group["params"]]
            yield
        finally:
            for group, params in zip(self.param_groups, groups, strict=True):
                group["params"] = params
            local_state, self.state = self.state, state
            for param, view in views:
                for name, value in local_state.get(view, {}).items():
                    if name not in state[param]:
                        state[param][name] = value if name == "step" else sharded_like(param, value)

    def _view(
        self, param: torch.Tensor, state: Any, views: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """A fresh alias of ``param``'s shard carrying its gradient's shard and its state's shards."""
        view = local_shard(param).detach()
        if param.grad is not None:
            view.grad = local_shard(param.grad)
        if param in state:
            self.state[view] = {name: local_shard(value) for name, value in state[param].items()}
        views.append((param, view))
        return view


def build_optimizer(module: nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the sharded trainable parameters; each rank steps on its own shards.

    The learning rate starts at ``config.lr`` and is then driven by core's LR schedule. On CUDA the fused
    kernel updates every parameter in a few launches; elsewhere (CPU, or parameters the CPU offload policy
    keeps on the host) ``foreach`` is explicit because torch picks the per-tensor loop for DTensor parameters
    otherwise.
    """
    params = trainable_parameters(module)
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    return ShardLocalAdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        **({"fused": True} if on_cuda else {"foreach": True}),
    )


def clip_grad_norm(module: nn.Module, max_norm: float | None) -> float:
    """The global gradient norm over every rank's shards, clipping to ``max_norm`` unless it is ``None``.

    The same arithmetic as ``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients: the norm of each
    rank's shards, raised to the power 2, summed over the ranks that shard the parameters, and the root of
    that (DTensor's reduction of a partial norm); then every shard scaled by ``max_norm / (norm + 1e-6)``
    clamped to 1.
    """
    grads = [p.grad for p in trainable_parameters(module) if p.grad is not None]
    if not grads:
        return 0.0
    local = [local_shard(g) for g in grads]
    norm = torch.nn.utils.get_total_norm(local, NORM_TYPE)
    sharded = _shard_groups(grads)
    if sharded is not None:
        norm = norm**NORM_TYPE
        for group in sharded:
            dist.all_reduce(norm, group=group)
        norm = norm ** (1.0 / NORM_TYPE)
    if max_norm is not None:
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for device_grads in _by_device(local).values():
            torch._foreach_mul_(device_grads, coefficient.to(device_grads[0].device))
    return float(norm.item())


def _shard_groups(grads: list[torch.Tensor]) -> list[dist.ProcessGroup] | None:
    """The process groups of the mesh dimensions the gradients are sharded over (``None``: plain tensors).

    Raises:
        ValueError: the gradients mix plain tensors and DTensors, or DTensors of different layouts (FSDP2
            shards every parameter alike; another layout would need its own reduction).
    """
    first = grads[0]
    if not isinstance(first, DTensor):
        if any(isinstance(g, DTensor) for g in grads):
            raise ValueError("clip_grad_norm: gradients mix DTensors and plain tensors.")
        return None
    mesh, placements = first.device_mesh, first.placements
    if any(not isinstance(g, DTensor) or g.device_mesh != mesh or g.placements != placements for g in grads):
        raise ValueError("clip_grad_norm: gradients are sharded over different meshes or placements.")
    return [mesh.get_group(dim) for dim, placement in enumerate(placements) if placement.is_shard()]


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    grouped: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        grouped.setdefault(tensor.device, []).append(tensor)
    return grouped
