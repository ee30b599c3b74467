"""Moving parameters, gradients and optimizer state between the compute device and CPU, cheaply.

- Gradients are freed, not moved, when nothing needs them any more (:func:`free_gradients`): after an optimizer
  step they are dead until the next ``zero_grad``. Only gradients of a backward whose optimizer step has not run
  yet are kept (moved with the parameters), so that a caller may accumulate across ``train_mode`` blocks.
- Everything offloaded goes into host buffers allocated once per tensor (pinned when the device is an
  accelerator) and reused on every offload (:class:`HostBuffers`): a copy into pinned memory runs at the
  link's speed (a pageable one is staged through a bounce buffer), and the load from it is an asynchronous
  DMA. Loads are non-blocking; the caller waits for the compute stream once after a load or an offload.
  The optimizer state may load on a side stream instead (:func:`load_optimizer_state_on`).
- Parameters are parked through the module's ``_apply`` (what ``module.to()`` runs), so FSDP2 re-registers its
  sharded parameters as it does after ``to()``; each parameter's copy into its buffer completes before
  ``_apply`` returns, because FSDP2 reads the new local tensor on the host when it re-pads an uneven shard
  (such a shard then lives in FSDP2's padded copy, not in our buffer).

Every move reports its bytes; ``placement.Placement`` times them and keeps the last load and offload.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from .shards import local_shard, sharded_like


class HostBuffers:
    """One host tensor per key, allocated on first use and reused afterwards (pinned on an accelerator)."""

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._pointers: set[int] = set()

    def stash(self, key: Hashable, tensor: torch.Tensor, *, non_blocking: bool = True) -> torch.Tensor:
        """Copy ``tensor`` into its host buffer; non-blocking by default (the caller syncs before reading)."""
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            if buffer is not None:
                self._pointers.discard(buffer.data_ptr())
            pin = tensor.device.type != "cpu" and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
            if buffer.numel():
                self._pointers.add(buffer.data_ptr())
        buffer.copy_(tensor, non_blocking=non_blocking)
        return buffer

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of the buffers (a CPU tensor starting where a buffer starts)."""
        return tensor.device.type == "cpu" and tensor.numel() > 0 and tensor.data_ptr() in self._pointers


def synchronize(device: str) -> None:
    """Wait for the copies queued on the current stream (a no-op on CPU).

    Only the current stream: the optimizer state's load on a side stream (:func:`load_optimizer_state_on`)
    keeps running.
    """
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


def free_gradients(module: nn.Module) -> None:
    """Drop every gradient (as ``zero_grad(set_to_none=True)`` does): nothing is moved."""
    for param in module.parameters():
        param.grad = None


def move_parameters(module: nn.Module, device: str, buffers: HostBuffers | None = None) -> int:
    """Move the module's parameters (and any gradients and buffers it holds) to ``device``.

    With ``buffers``, a move to CPU parks every tensor in its reused host buffer (:func:`_parking`); a move to
    an accelerator is non-blocking (the caller syncs once after it).

    Returns:
        The bytes of parameters and gradients that changed device.
    """
    moved = sum(
        _nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0)
        for p in module.parameters()
        if _device_type(p) != device
    )
    if device == "cpu" and buffers is not None:
        # NOTE: ``_apply`` is what ``module.to()`` runs, with our function instead of ``Tensor.to``; FSDP2
        # overrides it to re-register its sharded parameters afterwards.
        module._apply(_parking(buffers))
    else:
        module.to(device, non_blocking=device != "cpu")
    return moved


def _parking(buffers: HostBuffers) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``_apply`` maps over parameters, gradients and buffers: each into its host buffer.

    Keys are the visiting order, the same on every offload of the module. A tensor already in a buffer
    (a tied weight met twice, an engine whose device is the CPU after its first offload) is left as it is.
    The copy blocks (see the module's docstring).
    """
    keys = itertools.count()

    def park(tensor: torch.Tensor) -> torch.Tensor:
        key, local = next(keys), local_shard(tensor)
        if buffers.holds(local):
            return tensor
        return sharded_like(tensor, buffers.stash(key, local, non_blocking=False))

    return park


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
                state[name] = sharded_like(value, buffers.stash((index, name), local_shard(value)))
            else:
                state[name] = sharded_like(value, local_shard(value).to(device, non_blocking=True))
    return moved


def load_optimizer_state_on(optimizer: torch.optim.Optimizer, stream: Any) -> tuple[int, Any]:
    """Copy the optimizer state to CUDA on ``stream`` (a side stream); returns ``(bytes, arrival event)``.

    The copies start once the current stream's queued work is done and are marked as used by it, so the
    caching allocator keeps their memory until the current stream's reads are done too. Readers of the state
    must make the current stream wait for the returned event first.
    """
    compute = torch.cuda.current_stream()
    stream.wait_stream(compute)
    with torch.cuda.stream(stream):
        moved = move_optimizer_state(optimizer, "cuda")
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and _device_type(value) == "cuda":
                local_shard(value).record_stream(compute)
    return moved, stream.record_event()


def _device_type(tensor: torch.Tensor) -> str:
    return local_shard(tensor).device.type


def _nbytes(tensor: torch.Tensor) -> int:
    local = local_shard(tensor)
    return local.numel() * local.element_size()
