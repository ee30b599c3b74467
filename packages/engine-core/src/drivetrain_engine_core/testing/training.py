"""The training loop tests compare with a reference: one ``train_batch`` and one LR step per batch."""

from __future__ import annotations

from collections.abc import Sequence

from tensordict import TensorDict

from drivetrain_engine_core._engine import Engine
from drivetrain_engine_core._outputs import LossFn


def train_history(
    engine: Engine, batches: Sequence[TensorDict], loss_fn: LossFn
) -> list[tuple[float, float]]:
    """``(loss, grad norm)`` of each step: ``train_batch`` then ``lr_scheduler_step``, inside ``train_mode``.

    The same sequence as :func:`~drivetrain_engine_core.testing.reference.reference_train_losses`, so the two
    lists compare step by step.
    """
    history = []
    with engine.train_mode():
        for batch in batches:
            output = engine.train_batch(batch, loss_fn)
            engine.lr_scheduler_step()
            history.append((float(output.loss or 0.0), float(output.metrics["grad_norm"])))  # type: ignore[arg-type]
    return history
