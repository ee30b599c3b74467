"""The PPO critic: values of a rollout, and clipped value updates over mini-batches and epochs."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import agreed_checks, validate_batch
from tensordict import TensorDict

from .batch_inputs import RoleBatch
from .losses.value import ValueLossConfig, value_loss_fn
from .mini_batches import UpdateSchedule, iterate_mini_batches
from .update_metrics import UpdateMetrics
from .updating_role import UpdatingRole

VALUE_METRICS: tuple[str, ...] = ("vf_loss", "vf_clipfrac")


@dataclass(kw_only=True, frozen=True)
class CriticConfig:
    """Settings of the critic.

    Attributes:
        loss: the clipped value loss.
        schedule: mini-batch size, epochs and shuffling of an update.
    """

    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    schedule: UpdateSchedule = field(default_factory=UpdateSchedule)


class Critic(UpdatingRole):
    """Value role over any value-model :class:`~drivetrain_engine_core.backend.Engine`.

    Args:
        engine: an initialised value-model engine with an optimizer.
        config: critic settings.
    """

    def __init__(self, engine: Engine, config: CriticConfig | None = None) -> None:
        super().__init__(engine)
        self.config = config or CriticConfig()

    def compute_values(self, batch: TensorDict) -> TensorDict | None:
        """Per-token ``values`` (ARCHITECTURE §7.1 alignment) in the batch's form, on the output rank."""
        role_batch = RoleBatch.wrap(batch)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(role_batch.nopad)
        return role_batch.restore(output.outputs)

    def update_critic(self, batch: TensorDict) -> dict[str, float]:
        """Clipped value updates over the batch (fields ``values``, ``returns``, ``loss_mask``).

        Returns:
            Means over the optimizer steps of ``vf_loss``, ``vf_clipfrac``, ``grad_norm``, and the ``lr``.
        """
        with agreed_checks(self.engine.data_parallel_group):  # a bad share fails every rank, none waits
            nopad = RoleBatch.wrap(batch, needs_loss_mask=True).nopad
            validate_batch(nopad, required=["input_ids", "position_ids", "loss_mask", "values", "returns"])
        loss_fn = value_loss_fn(self.config.loss)
        metrics = UpdateMetrics(self.engine.data_parallel_group)
        with self.engine.train_mode():
            for mini_batch in iterate_mini_batches(
                nopad, self.config.schedule, self.engine.data_parallel_group, self.updates_done
            ):
                metrics.add(self.engine.train_batch(mini_batch, loss_fn), VALUE_METRICS)
            self.engine.lr_scheduler_step()
        self.updates_done += 1
        return metrics.summary()
