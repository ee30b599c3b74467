"""The PPO training loop over any installed engine backend and rollout: the shared policy job with a critic.

One process per rank (``torchrun`` or ``drivetrain ppo --nproc N``). The job is
:class:`~drivetrain_roles.rl.policy_trainer.PolicyTrainer` (the start policy: a model directory, or the embedded
job's SFT warm start; the prompts; the actor; the reference, when a KL term reads it; the rollout; each step:
sample, score, update, hand off), plus the critic: a value model on its own engine, started from the same policy
with a fresh value head (``<run>/critic_start``). PPO fills in its own (:mod:`.step`): every response in the
batch, values and GAE, the critic's update, the actor's after ``trainer.critic_warmup`` steps (the weight
hand-off only then). Checkpoints hold the critic and the KL coefficient beside the actor
(:class:`.run_folder.PPORunFolder`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from drivetrain_engine_core.backend import Engine

from ..critic import Critic, CriticConfig
from ..jobs.curves import Panel, Series
from ..jobs.data import Example
from ..output_ranks import require_outputs_on_every_rank
from ..rl.batch import RolloutBatch
from ..rl.curves import POLICY_CURVES
from ..rl.episodes import EpisodeBatch
from ..rl.pipeline import GeneratedBatch
from ..rl.policy_trainer import PolicyJobResult, PolicyTrainer, StepTiming
from ..rl.rewards import Scores
from ..rl.step_record import StepRecord
from ..rm.export import write_value_model_start
from .config import PPOConfig
from .run_folder import PPORunFolder
from .step import CRITIC_PREFIX, episodes_batch, scored_batch, update

CRITIC_START_DIR = "critic_start"
"""In the run folder: the critic's start (the policy's weights linked, its config set up for one value)."""


class PPOTrainer(PolicyTrainer[PPOConfig]):
    """PPO with a critic, GAE and an exact-answer reward.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.ppo.config.load_config`).
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints``.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over.
    """

    command = "ppo"
    curves = POLICY_CURVES.with_panels(
        Panel(
            title="critic's explained variance of the returns",
            series=(Series(key="critic/vf_explained_var", label="train"),),
        )
    )

    def _setup(self) -> Engine:
        """The shared setup (start policy, prompts, actor, reference, rollout); the critic comes with the start
        step."""
        engine = super()._setup()
        self.kl_control = self.config.algorithm.kl_ctrl.controller()
        return engine

    def make_critic(self, model_path: str) -> Critic:
        """The critic: a value model of ``model_path``'s trunk with a fresh head, on its own training engine,
        with the actor's mini-batches and epochs and the clipped value loss."""
        from drivetrain_engine_core.job import create_engine

        config = self.config
        start = write_value_model_start(model_path, self.output_dir / CRITIC_START_DIR)
        engine = create_engine(
            # NOTE: the whole critic trains (no LoRA): a fresh head under a frozen trunk learns little.
            model_config=dataclasses.replace(config.model, path=start, model_type="value_model", lora=None),
            engine_config=config.engine,
            optimizer_config=config.run_critic_optimizer(),
            checkpoint_config=config.checkpoint,
        )
        engine.initialize()
        require_outputs_on_every_rank(engine, "drivetrain ppo")
        schedule = self.actor.config.schedule
        return Critic(engine, CriticConfig(loss=config.algorithm.value_loss(), schedule=schedule))

    def _uses_reference(self) -> bool:
        return self.config.algorithm.needs_reference

    def _start_step(self, engine: Engine) -> int:
        """The actor's start step (a resumed checkpoint checked against this run), then the critic, resumed at
        that step with the KL coefficient saved beside it.

        NOTE: the critic is made only once the actor's checkpoint has loaded and matched the run: making it
        rebuilds ``<run>/critic_start``, which a resume refused there (another model, another seed) left linked
        to the refused model. A resumed run's numbers are unchanged: the critic's checkpoint restores the RNG
        state its fresh head drew from.
        """
        step = super()._start_step(engine)
        self.critic = self.make_critic(self.model_path)
        self.folder = PPORunFolder.around(self.folder, self.critic, self.kl_control)
        self.folder.resume_critic(step)
        # The actor updates only after the critic's warm-up: its update count seeds its mini-batch shuffle.
        self.actor.updates_done = max(0, step - self.config.trainer.critic_warmup)
        return step

    # ------------------------------------------------------------------ loop

    def _trains_actor(self, step: int) -> bool:
        """Whether ``step`` updates the actor (after ``trainer.critic_warmup`` steps of the critic alone)."""
        return step >= self.config.trainer.critic_warmup

    def _batch(
        self, step: int, examples: list[Example], generated: GeneratedBatch, scores: Scores
    ) -> RolloutBatch:
        if isinstance(generated, EpisodeBatch):
            return episodes_batch(generated, scores, self.config)
        return scored_batch(examples, generated.output, scores, self.config)

    def _update(self, step: int, samples: RolloutBatch) -> dict[str, float]:
        kl_coef = self.kl_control.value
        return update(
            self.actor,
            self.reference,
            self.critic,
            samples,
            self.config.algorithm,
            kl_coef,
            train_actor=self._trains_actor(step),
        )

    def _hand_off(self, step: int) -> Mapping[str, float]:
        """The shared hand-off once the actor trains; none while it is frozen (the rollout serves its weights)."""
        return super()._hand_off(step) if self._trains_actor(step) else {}

    def _command_metrics(
        self, record: StepRecord, samples: RolloutBatch, timing: StepTiming, result: PolicyJobResult
    ) -> dict[str, float]:
        """The KL coefficient the step's reward used (then moved by the adaptive controller towards the step's KL)
        and the critic's metrics."""
        update = record.update
        values = {"train/kl_coef": self.kl_control.value}
        if "kl" in update:
            self.kl_control.update(update["kl"], n_steps=int(record.totals.count))
        values.update({k: v for k, v in update.items() if k.startswith(CRITIC_PREFIX)})
        return values
