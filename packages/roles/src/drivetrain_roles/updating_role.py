"""What the roles that update their engine (actor, critic) share: the update count and its checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import Engine

UPDATES_DONE_KEY = "updates_done"


class UpdatingRole:
    """A role whose updates walk shuffled mini-batches seeded by the update count.

    Args:
        engine: an initialised engine with an optimizer.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.updates_done = 0
        """Updates so far; seeds each update's mini-batch shuffle, so a role restored from a checkpoint (see
        :meth:`load_checkpoint`) shuffles exactly as the uninterrupted one did."""

    def save_checkpoint(
        self, path: str | Path, global_step: int, extra_state: dict[str, Any] | None = None
    ) -> Path:
        """The engine's checkpoint (collective), with the update count beside the caller's ``extra_state``.

        NOTE: a worker group reaches only role methods; without these a role in a Ray worker could be
        checkpointed only through its engine, and lost its update count (its shuffle order) on resume.
        """
        state = {**(extra_state or {}), UPDATES_DONE_KEY: self.updates_done}
        return self.engine.save_checkpoint(path, global_step, extra_state=state)

    def load_checkpoint(self, path: str | Path, *, load_optimizer: bool = True) -> dict[str, Any]:
        """Load a step (or the root's ``latest``) into the engine and restore the update count; returns the
        engine's ``{"global_step": N, **extra_state}``."""
        state = self.engine.load_checkpoint(path, load_optimizer=load_optimizer)
        self.updates_done = int(state.get(UPDATES_DONE_KEY, self.updates_done))
        return state
