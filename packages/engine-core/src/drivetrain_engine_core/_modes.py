"""Nested ``train_mode``/``eval_mode`` blocks: the current mode, and the state each block loads and offloads.

The engine hands in its hooks, so the stack needs no engine internals. Only the outermost block loads and
offloads, except that a train block inside an eval block loads the optimizer state the eval block left on the
host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

Mode = Literal["train", "eval"]


class ModeStack:
    """The engine's mode blocks.

    Args:
        set_mode: the backend's ``_set_mode`` hook.
        load: ``load(params=..., optimizer=...)`` brings offloaded state to the device (``None``: the
            backend never offloads).
        offload: moves to the host what the config offloads (``None`` as for ``load``).
    """

    def __init__(
        self,
        set_mode: Callable[[Mode], None],
        load: Callable[..., None] | None = None,
        offload: Callable[[], None] | None = None,
    ) -> None:
        self._set_mode = set_mode
        self._load = load
        self._offload = offload
        self._stack: list[Mode] = []

    @property
    def current(self) -> Mode | None:
        """The innermost block's mode, ``None`` outside every block."""
        return self._stack[-1] if self._stack else None

    @contextmanager
    def enter(self, mode: Mode) -> Iterator[None]:
        """One block: load what it needs, switch the mode, and restore both when it ends (even by an error)."""
        outermost = not self._stack
        if self._load is not None:
            if outermost:
                self._load(params=True, optimizer=mode == "train")
            elif mode == "train" and "train" not in self._stack:
                # NOTE: an eval block loaded the parameters only: a train block inside it needs the optimizer
                # state too (it stayed on the host, and the step failed on mixed devices).
                self._load(params=False, optimizer=True)
        previous = self.current
        self._stack.append(mode)
        if previous != mode:
            self._set_mode(mode)
        try:
            yield
        finally:
            self._stack.pop()
            if self._stack and self.current != mode:
                self._set_mode(self._stack[-1])
            if outermost and self._offload is not None:
                self._offload()
