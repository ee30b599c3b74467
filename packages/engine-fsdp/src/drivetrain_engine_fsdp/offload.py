"""Moving parameters, gradients and optimizer state between the compute device and CPU.

FSDP2 modules re-register their sharded parameters after ``module.to()``, so moving the module is the
supported way to move parameters (their gradients follow). Optimizer state is moved tensor by tensor.
"""

from __future__ import annotations

import torch
from torch import nn


def move_parameters(module: nn.Module, device: str) -> None:
    """Move the module's parameters (and their gradients) to ``device``."""
    module.to(device)


def move_gradients(module: nn.Module, device: str) -> None:
    """Move only the gradients to ``device`` (parameters stay where they are)."""
    for param in module.parameters():
        if param.grad is not None:
            param.grad = param.grad.to(device)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Move every tensor of the optimizer's per-parameter state (AdamW moments, step) to ``device``."""
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                state[name] = value.to(device)
