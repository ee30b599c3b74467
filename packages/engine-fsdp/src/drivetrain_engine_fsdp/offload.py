"""Moving parameters, gradients and optimizer state between the compute device and CPU, cheaply.

- Gradients are freed, not moved, when nothing needs them any more (:func:`free_gradients`): after an optimizer
  step they are dead until the next ``zero_grad``. Only gradients of a backward whose optimizer step has not run
  yet are kept (moved with the parameters), so that a caller may accumulate across ``train_mode`` blocks.
- Optimizer state goes into host buffers allocated once per state tensor (pinned when the device is an
  accelerator) and reused on every offload: ``copy_(non_blocking=True)`` into them, one device sync after the
  last copy. Loading copies them back without blocking the host (the compute stream orders the copies before the
  step that reads them).
- Parameters move with ``module.to()``: FSDP2 re-registers (and re-pads) its sharded parameters after it, so a
  host buffer of ours would be copied into a fresh padded tensor anyway; moving the module is the supported way.

Every move reports its seconds and bytes (:class:`Transfer`); the engine keeps the last load and offload.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class Transfer:
    """What one load or offload moved: wall seconds (the device waited for) and bytes."""

    seconds: float = 0.0
    bytes: int = 0

    def add(self, seconds: float, moved: int) -> None:
        self.seconds += seconds
        self.bytes += moved


class HostBuffers:
    """One host tensor per key, allocated on first use and reused afterwards (pinned on an accelerator)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}

    def stash(self, key: tuple[int, str], tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into its host buffer without blocking; the caller syncs before reading it."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type != "cpu" and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=True)
        return buffer


def synchronize(device: str) -> None:
    """Wait for the device's queued copies (a no-op on CPU)."""
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gradients(module: nn.Module) -> None:
    """Drop every gradient (as ``zero_grad(set_to_none=True)`` does): nothing is moved."""
    for param in module.parameters():
        param.grad = None


def move_parameters(module: nn.Module, device: str) -> int:
    """Move the module's parameters (and any gradients they hold) to ``device``; returns the bytes moved."""
    moved = sum(
        _nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0)
        for p in module.parameters()
        if _device_type(p) != device
    )
    module.to(device)
    return moved


def move_gradients(module: nn.Module, device: str) -> None:
    """Move only the gradients to ``device`` (parameters stay where they are)."""
    for param in module.parameters():
        if param.grad is not None:
            param.grad = param.grad.to(device)


def move_optimizer_state(
    optimizer: torch.optim.Optimizer, device: str, buffers: HostBuffers | None = None
) -> int:
    """Move every tensor of the optimizer's per-parameter state (AdamW moments, step) to ``device``.

    With ``buffers``, a move to CPU copies into the reused host buffers (the caller syncs once after it).

    Returns:
        The bytes that changed device.
    """
    moved = 0
    for index, state in enumerate(optimizer.state.values()):
        for name, value in state.items():
            if not isinstance(value, torch.Tensor) or _device_type(value) == device:
                continue
            moved += _nbytes(value)
            if device == "cpu" and buffers is not None:
                state[name] = _rewrap(value, buffers.stash((index, name), _local(value)))
            else:
                state[name] = _rewrap(value, _local(value).to(device, non_blocking=True))
    return moved


def timed(device: str, move: Callable[[], int]) -> tuple[float, int]:
    """``(seconds, bytes)`` of ``move()``, waiting for the device at the end (one sync, if anything moved)."""
    start = time.perf_counter()
    moved = move()
    if moved:
        synchronize(device)
    return time.perf_counter() - start, moved


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``like``'s kind: a DTensor on the same mesh and placements, or plain."""
    if not isinstance(like, DTensor):
        return local
    # NOTE: not ``DTensor.from_local``: it moves ``local`` to the mesh's device type, so a host buffer on a
    # CUDA mesh went straight back to the GPU (the offload freed nothing and cost two copies). Wrapped in
    # place, as FSDP2 wraps its own CPU-offloaded parameters; shape, stride, mesh and placements are ``like``'s.
    return DTensor(local, like._spec, requires_grad=False)


def _device_type(tensor: torch.Tensor) -> str:
    return _local(tensor).device.type


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()
