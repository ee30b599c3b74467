"""The learning-rate schedule every backend uses: linear warm-up, then constant, cosine or linear decay.

It writes ``lr`` into optimizer parameter groups directly instead of wrapping a ``torch.optim`` scheduler, so
it also drives optimizers that are not ``torch.optim.Optimizer`` instances (Megatron's distributed
optimizer), and its state is two numbers that checkpoint as JSON.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ._config import OptimizerConfig


def lr_at_step(config: OptimizerConfig, step: int) -> float:
    """Learning rate after ``step`` scheduler steps (step 0 is the first optimizer update)."""
    if config.warmup_steps > 0 and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    assert config.total_steps is not None  # guaranteed by OptimizerConfig validation
    decay_steps = config.total_steps - config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    floor = config.lr * config.min_lr_ratio
    remaining = (
        1.0 - progress if config.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    )
    return floor + (config.lr - floor) * remaining


class LRSchedule:
    """Stateful schedule over the parameter groups returned by ``param_groups``.

    ``param_groups`` is a callable so that backends that rebuild their groups (offload, resharding) are
    always seen as they are now.
    """

    def __init__(self, config: OptimizerConfig, param_groups: Callable[[], Sequence[dict[str, Any]]]):
        self._config = config
        self._param_groups = param_groups
        self._step = 0
        self._apply()

    @property
    def current_lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return lr_at_step(self._config, self._step)

    def step(self) -> float:
        """Advance one step and return the new learning rate."""
        self._step += 1
        self._apply()
        return self.current_lr

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._step = int(state["step"])
        self._apply()

    def _apply(self) -> None:
        lr = self.current_lr
        for group in self._param_groups():
            group["lr"] = lr
