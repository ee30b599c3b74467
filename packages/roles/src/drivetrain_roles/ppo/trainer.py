"""The PPO training loop over any installed engine backend and rollout: ``drivetrain grpo``'s job with a critic.

One process per rank (``torchrun`` or ``drivetrain ppo --nproc N``). Setup, as ``drivetrain grpo``'s (the start
policy: a model directory, or the embedded job's SFT warm start; the prompts; the actor; the reference, when a
KL term reads it; the rollout), then the critic: a value model on its own engine, started from the same policy
with a fresh value head (``<run>/critic_start``). Each step (:mod:`.step`): sample and score, values and GAE,
the critic's update, the actor's after ``trainer.critic_warmup`` steps, the weight hand-off. Evaluation (held-out
greedy accuracy through the rollout), the final model and the curve are GRPO's; checkpoints hold the critic and
the KL coefficient beside the actor (:class:`.run_folder.PPORunFolder`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from drivetrain_engine_core import distributed
from drivetrain_engine_core.engine import Engine

from ..critic import Critic, CriticConfig
from ..grpo.rewards import reward_metrics
from ..grpo.step import SEED_STRIDE, hand_off
from ..grpo.trainer import GRPOResult, GRPOTrainer
from ..output_ranks import require_outputs_on_every_rank
from ..rm.export import write_value_model_start
from .config import PPOConfig
from .run_folder import PPORunFolder
from .step import sample, update

CRITIC_START_DIR = "critic_start"
"""In the run folder: the critic's start (the policy's weights linked, its config set up for one value)."""
ACTOR_METRICS = {
    "pg_loss": "train/pg_loss",
    "pg_clipfrac": "train/clip_fraction",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
}
"""The actor's update metrics in a step's record (absent during the critic's warm-up)."""


class PPOTrainer(GRPOTrainer[PPOConfig]):
    """PPO with a critic, GAE and an exact-answer reward; ``drivetrain grpo``'s job otherwise.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.ppo.config.load_config`).
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints``.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over.
    """

    command = "ppo"
    result_type = GRPOResult

    def _setup(self) -> Engine:
        """GRPO's setup (start policy, prompts, actor, reference, rollout); the critic comes with the start step."""
        engine = super()._setup()
        self.kl_control = self.config.algorithm.kl_ctrl.controller()
        return engine

    def make_critic(self, model_path: str) -> Critic:
        """The critic: a value model of ``model_path``'s trunk with a fresh head, on its own training engine,
        with the actor's mini-batches and epochs and the clipped value loss."""
        from drivetrain_engine_core.factory import create_engine

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

    def _step(self, step: int, result: GRPOResult) -> dict[str, float]:
        engine, config = self.actor.engine, self.config
        local = self.sampler.local_indices(step, engine.data_parallel_rank, engine.data_parallel_size)
        started = time.perf_counter()
        seed = config.trainer.seed + SEED_STRIDE * step + distributed.rank()
        samples = sample(self.rollout, [self.train[i] for i in local], self.tokenizer, config, seed=seed)
        train_actor = step >= config.trainer.critic_warmup
        kl_coef = self.kl_control.value
        metrics = update(
            self.actor,
            self.reference,
            self.critic,
            samples,
            config.algorithm,
            kl_coef,
            train_actor=train_actor,
        )
        rollout = config.rollout
        sync = (
            hand_off(self.actor, self.rollout, step + 1, rollout.bucket_mb, rollout.lora_handoff)
            if train_actor
            else {}
        )
        seconds = time.perf_counter() - started
        reward_sum, count, response_tokens, tokens = distributed.all_reduce_sums(
            [
                float(samples.rewards.sum()),
                len(samples.rewards),
                sum(samples.response_lengths),
                int(samples.batch["input_ids"].values().numel()),
            ],
            engine.data_parallel_group,
        )
        if "kl" in metrics:
            self.kl_control.update(metrics["kl"], n_steps=int(count))
        values = {
            "train/reward": reward_sum / count,
            **reward_metrics(samples.scores, engine.data_parallel_group),
            **{name: metrics[key] for key, name in ACTOR_METRICS.items() if key in metrics},
            "train/entropy": metrics["entropy"],
            "train/response_length": response_tokens / count,
            "train/kl_coef": kl_coef,
            **{k: v for k, v in metrics.items() if k.startswith("critic/")},
            "rollout/log_prob_diff_max": metrics["rollout/log_prob_diff_max"],
            "rollout/mismatch_kl": metrics["rollout/mismatch_kl"],
            "perf/step_time_s": seconds,
            "perf/tokens_per_s": tokens / seconds,
            **sync,
        }
        if "kl" in metrics or "kl_loss" in metrics:
            values["train/kl"] = metrics.get("kl", metrics.get("kl_loss", 0.0))
        result.rewards.append(values["train/reward"])
        return values

    def _plot(self, records: list[dict[str, Any]]) -> None:
        from ..jobs.metrics import plot_curves

        plot_curves(
            records,
            self.output_dir / self.curve_file,
            left=[
                ("train/reward", f"train reward ({self.config.algorithm.rewards().label})", "-"),
                ("critic/vf_explained_var", "critic's explained variance", ":"),
            ],
            left_label="mean reward / explained variance",
        )
