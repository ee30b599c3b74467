"""Where the FSDP engine's parameters and optimizer state are, and the moves that change it.

The engine's mode context managers call :meth:`Placement.load` on entry and :meth:`Placement.offload` on exit;
``engine.to()`` calls :meth:`Placement.to`. The copies themselves are :mod:`offload`'s.

On CUDA the optimizer state is loaded on a side stream: the optimizer step is the only reader, so its copy
runs while the forward and backward do (parameters are needed first and load on the compute stream). Every
reader of the state waits for its arrival first (:meth:`Placement.await_optimizer_state`: the optimizer
step, an offload, ``to()``, checkpoint save and load).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import offload


@dataclass(frozen=True)
class Transfer:
    """What one load or offload moved: wall seconds (ending with the compute stream's wait) and bytes."""

    seconds: float = 0.0
    bytes: int = 0


class Placement:
    """Residency of one engine's parameters and optimizer state, with the last load's and offload's cost.

    Args:
        module: The FSDP-wrapped model.
        optimizer: Its optimizer, or ``None`` for an inference engine.
        device: The engine's compute device (``"cuda"``, ``"cpu"``).
        home_device: Where parameters and optimizer state live during compute (``"cpu"`` under FSDP2's CPU
            offload policy, else ``device``).
    """

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, device: str, home_device: str
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.device, self.home_device = device, home_device
        self.params_on_cpu = False
        self.optimizer_on_cpu = False
        # Gradients of a backward whose optimizer step has not run: kept (moved) by an offload, else freed.
        self.grads_pending = False
        self.param_buffers = offload.HostBuffers()
        self.optimizer_buffers = offload.HostBuffers()
        self.transfers = {"load": Transfer(), "offload": Transfer()}
        self._copy_stream: Any = None
        self._optimizer_arrival: Any = None

    def load(self, *, params: bool, optimizer: bool) -> None:
        """Bring offloaded parameters (and optimizer state) back to the home device."""

        def move() -> int:
            moved = 0
            if params and self.params_on_cpu:
                moved += offload.move_parameters(self.module, self.home_device)
                self.params_on_cpu = False
            if optimizer and self.optimizer_on_cpu and self.optimizer is not None:
                moved += self._load_optimizer_state()
                self.optimizer_on_cpu = False
            return moved

        self._record("load", move)

    def offload(self, *, params: bool, optimizer: bool) -> None:
        """Free consumed gradients and park parameters (and optimizer state) in host buffers."""
        self.await_optimizer_state()

        def move() -> int:
            moved = 0
            if (params or optimizer) and not self.grads_pending:
                # NOTE: after the optimizer step the gradients are dead until the next zero_grad; moving them
                # would double the parameters' traffic for nothing.
                offload.free_gradients(self.module)
            if params and not self.params_on_cpu:
                moved += offload.move_parameters(self.module, "cpu", self.param_buffers)
                self.params_on_cpu = True
            if optimizer and not self.optimizer_on_cpu and self.optimizer is not None:
                moved += offload.move_optimizer_state(self.optimizer, "cpu", self.optimizer_buffers)
                self.optimizer_on_cpu = True
            return moved

        self._record("offload", move)

    def to(self, device: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        """``engine.to()``: move what is asked, synchronously, and remember where it is.

        The compute device means the home device: under FSDP2's CPU offload policy the state lives on the host
        during compute, and a wake-up ``to("cuda")`` that moved it there left host parameters (FSDP2 re-pins
        them) beside CUDA moments and gradients, so the next step failed on mixed devices.
        """
        self.await_optimizer_state()
        if device == self.device:
            device = self.home_device
        on_cpu = device == "cpu" and self.home_device != "cpu"
        del grad  # core allows it only with ``model``: gradients move with their parameters
        if model:
            offload.move_parameters(self.module, device)
            self.params_on_cpu = on_cpu
        if optimizer and self.optimizer is not None:
            offload.move_optimizer_state(self.optimizer, device)
            self.optimizer_on_cpu = on_cpu
        offload.synchronize(self.device)  # the compute device: a copy to the host is queued there

    def await_optimizer_state(self) -> None:
        """Order the compute stream after the optimizer state's side-stream copy (a no-op when none is due)."""
        if self._optimizer_arrival is not None:
            torch.cuda.current_stream().wait_event(self._optimizer_arrival)
            self._optimizer_arrival = None

    @property
    def transfer_metrics(self) -> dict[str, float]:
        """``perf/load_s``, ``perf/load_bytes``, ``perf/offload_s``, ``perf/offload_bytes`` of the last moves."""
        metrics = {}
        for kind, transfer in self.transfers.items():
            metrics[f"perf/{kind}_s"] = transfer.seconds
            metrics[f"perf/{kind}_bytes"] = float(transfer.bytes)
        return metrics

    def _load_optimizer_state(self) -> int:
        """Bring the optimizer state home; on CUDA on the side stream, its arrival kept for the readers."""
        assert self.optimizer is not None  # load() asks only with an optimizer
        if not (self.home_device == "cuda" and torch.cuda.is_available()):
            return offload.move_optimizer_state(self.optimizer, self.home_device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        moved, self._optimizer_arrival = offload.load_optimizer_state_on(self.optimizer, self._copy_stream)
        return moved

    def _record(self, kind: str, move: Callable[[], int]) -> None:
        start = time.perf_counter()
        moved = move()
        if moved:
            offload.synchronize(self.device)
            self.transfers[kind] = Transfer(seconds=time.perf_counter() - start, bytes=moved)
