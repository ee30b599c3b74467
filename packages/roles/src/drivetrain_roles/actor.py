"""The PPO actor: log-probs of a rollout, and clipped policy updates over mini-batches and epochs."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivetrain_engine_core.backend import Engine, ForwardOptions
from drivetrain_engine_core.job import LossFn, agreed_checks, validate_batch
from tensordict import TensorDict

from .batch_inputs import RoleBatch
from .losses.policy import PolicyLossConfig, policy_loss_fn
from .mini_batches import UpdateSchedule, iterate_mini_batches
from .update_metrics import UpdateMetrics
from .updating_role import UpdatingRole

POLICY_METRICS: tuple[str, ...] = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl")


@dataclass(frozen=True)
class PolicyObjective:
    """A policy loss for :meth:`Actor.update_policy`: :class:`ActorConfig`'s (PPO-clip, GSPO or CISPO) by default,
    or the caller's (a truncated importance-sampling correction against the rollout's log-probs, another
    KL form), with the actor's mini-batches, epochs, metric reduction and LR step around it.

    Attributes:
        loss_fn: core's loss contract (``loss_fn(outputs, micro_batch, context) -> (loss, metrics)``): each
            micro-batch's share of the mini-batch loss, normalised by ``context``'s global counts as
            :mod:`.losses` does, so an update does not depend on micro-batching or the number of ranks.
        metric_names: the metrics of ``loss_fn`` to report, each a per-micro-batch contribution that is summed
            over micro-batches and ranks (the same names on every rank).
        required_fields: batch fields besides ``input_ids``, ``position_ids`` and ``loss_mask`` that the loss
            reads, checked on every rank before the update.
        compute_entropy: whether the forward computes ``entropy`` for the loss.
    """

    loss_fn: LossFn
    metric_names: tuple[str, ...] = ()
    required_fields: tuple[str, ...] = ()
    compute_entropy: bool = False


@dataclass(kw_only=True, frozen=True)
class ActorConfig:
    """Settings of the actor.

    Attributes:
        loss: the PPO policy loss.
        schedule: mini-batch size, epochs and shuffling of an update.
        temperature: the rollout's sampling temperature; logits are divided by it before log-probs.
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    schedule: UpdateSchedule = field(default_factory=UpdateSchedule)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"actor temperature must be > 0, got {self.temperature}.")


class Actor(UpdatingRole):
    """Policy role over any :class:`~drivetrain_engine_core.backend.Engine` with an optimizer.

    Batches may be no-padding (jagged) or left-right padded; outputs come back in the same form.

    Args:
        engine: an initialised language-model engine.
        config: actor settings.
    """

    def __init__(self, engine: Engine, config: ActorConfig | None = None) -> None:
        super().__init__(engine)
        self.config = config or ActorConfig()

    def compute_log_prob(self, batch: TensorDict, *, calculate_entropy: bool = False) -> TensorDict | None:
        """Per-token ``log_probs`` (and ``entropy``) of the batch's tokens under the current policy.

        Returns:
            A TensorDict with ``log_probs`` (and ``entropy``) in the batch's form (jagged or padded), on the
            output rank; ``None`` elsewhere.
        """
        role_batch = RoleBatch.wrap(batch)
        options = ForwardOptions(temperature=self.config.temperature, compute_entropy=calculate_entropy)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(role_batch.nopad, options=options)
        return role_batch.restore(output.outputs)

    def update_policy(self, batch: TensorDict, objective: PolicyObjective | None = None) -> dict[str, float]:
        """Policy updates over the batch (PPO's clipped surrogate, or ``objective``); one LR-schedule step at the
        end.

        The batch (this rank's share of a rollout) needs ``loss_mask`` and, for PPO, ``old_log_probs``,
        ``advantages`` and, with a KL loss, ``ref_log_prob`` (another objective: its ``required_fields``).

        The forward computes the entropy only when the loss has an entropy bonus (``entropy_coeff > 0``):
        otherwise the token outputs need the log-probs alone, which a fused log-prob kernel computes without
        the logits (the entropy of the rollout's policy comes from :meth:`compute_log_prob` instead).

        Returns:
            Means over the optimizer steps of the objective's metrics (PPO: ``pg_loss``, ``pg_clipfrac``,
            ``pg_clipfrac_lower``, ``approx_kl``, with an entropy bonus ``entropy``, with a KL loss
            ``kl_loss``), ``grad_norm``, and the ``lr`` used.
        """
        objective = objective or self.ppo_objective()
        required = ["input_ids", "position_ids", "loss_mask", *objective.required_fields]
        with agreed_checks(self.engine.data_parallel_group):  # a bad share fails every rank, none waits
            nopad = RoleBatch.wrap(batch, needs_loss_mask=True).nopad
            validate_batch(nopad, required=required)
        metrics = UpdateMetrics(self.engine.data_parallel_group)
        options = ForwardOptions(
            temperature=self.config.temperature, compute_entropy=objective.compute_entropy
        )
        with self.engine.train_mode():
            for mini_batch in iterate_mini_batches(
                nopad, self.config.schedule, self.engine.data_parallel_group, self.updates_done
            ):
                output = self.engine.train_batch(mini_batch, objective.loss_fn, options=options)
                metrics.add(output, objective.metric_names)
            self.engine.lr_scheduler_step()
        self.updates_done += 1
        return metrics.summary()

    def ppo_objective(self) -> PolicyObjective:
        """The clipped PPO surrogate of ``config.loss`` as a :class:`PolicyObjective`."""
        loss = self.config.loss
        return PolicyObjective(
            loss_fn=policy_loss_fn(loss),
            metric_names=(
                *POLICY_METRICS,
                *(("entropy",) if loss.uses_entropy else ()),
                *(("kl_loss",) if loss.uses_kl else ()),
                *(("rollout_is_weight", "rollout_is_capped") if loss.uses_rollout_is else ()),
            ),
            required_fields=(
                "old_log_probs",
                "advantages",
                *(("ref_log_prob",) if loss.uses_kl else ()),
                *(("rollout_log_probs",) if loss.uses_rollout_is else ()),
            ),
            compute_entropy=loss.uses_entropy,
        )
