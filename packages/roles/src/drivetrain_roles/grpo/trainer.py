"""The GRPO training loop over any installed engine backend and rollout.

One process per rank (``torchrun`` or ``drivetrain grpo --nproc N``). Setup: the start policy (a model
directory, or the embedded job's SFT warm start), the actor engine, the reference (its own inference-only
engine, or the actor's base model with LoRA; none when ``algorithm.kl_loss_coef`` is 0) and the rollout
(``rollout.name``). Each step (:mod:`.step`): sample and reward this rank's prompts, one PPO-clip update,
weight hand-off; ``trainer.mode`` says whether the samples come from the step's own weights or from a rollout
thread generating ahead (:mod:`.pipeline`, :mod:`.versions`). Held-out greedy accuracy (through the rollout, i.e. the synced weights) before the first
step, every ``trainer.eval_every`` steps and after the last; checkpoints in ``<run>/checkpoints``; ``resume``
continues from the latest one (the rollout is synced from it first); the run ends with ``final_model``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from drivetrain_engine_core import distributed
from drivetrain_engine_core.agreement import agreed_checks
from drivetrain_engine_core.engine import Engine
from drivetrain_engine_core.rollout import SamplingConfig

from ..actor import Actor, ActorConfig
from ..jobs.assets import load_splits
from ..jobs.batches import StepSampler
from ..jobs.builtin_tasks import data_task
from ..jobs.data import Example
from ..jobs.final_model import save_final_model
from ..jobs.job import JobResult, TrainingJob
from ..jobs.metrics import plot_curves
from ..mini_batches import UpdateSchedule
from ..output_ranks import require_outputs_on_every_rank
from ..reference import Reference
from ..update_metrics import ENGINE_LOSS_METRICS
from .config import GRPOConfig, PolicyJobConfig, check_mini_batch_share, generation_lag
from .pipeline import RolloutPipeline
from .prompt_checks import check_rollout_length, warn_unreachable_answers
from .rewards import EXACT_MATCH, check_reward_inputs, exact_match, load_rewards, reward_metrics
from .rollout_plugin import build_rollout, require_rollout
from .step import SEED_STRIDE, answer_rewards, hand_off, sampling_config, score_agreed, update
from .versions import Versions, staleness_metrics
from .warm_start import start_model

CURVE_FILE = "reward_curve.png"


def actor_config(config: PolicyJobConfig) -> ActorConfig:
    """The GRPO actor: ``algorithm.loss_mode``'s loss with the KL penalty, ``algorithm.ppo_mini_batches``
    optimizer steps per pass over a rollout, ``algorithm.ppo_epochs`` passes (1 and 1: on-policy GRPO)."""
    algorithm = config.algorithm
    loss = algorithm.policy_loss(max_new_tokens=config.rollout.max_new_tokens)
    sequences = config.trainer.prompts_per_step * config.rollout.n
    schedule = UpdateSchedule(
        mini_batch_size=-(-sequences // algorithm.ppo_mini_batches),
        epochs=algorithm.ppo_epochs,
        shuffle=algorithm.ppo_mini_batches > 1 or algorithm.ppo_epochs > 1,
        seed=config.trainer.seed,
    )
    return ActorConfig(loss=loss, schedule=schedule, temperature=config.rollout.temperature)


@dataclass
class GRPOResult(JobResult):
    """What a run did, on every rank (see :class:`~drivetrain_roles.jobs.job.JobResult`).

    Attributes:
        rewards: mean training reward of each step this process ran.
        seconds: wall time of the GRPO loop (warm start and setup excluded).
        timing: this process's seconds ``generating`` (the rollout), ``training`` (update and hand-off) and
            ``overlapped`` (generation that ran while the trainer trained), summed over its steps.
        dropped_samples: responses left out of the loss as older than ``trainer.max_staleness`` (all ranks).
    """

    rewards: list[float] = field(default_factory=list)
    seconds: float = 0.0
    timing: dict[str, float] = field(
        default_factory=lambda: {"generating": 0.0, "training": 0.0, "overlapped": 0.0}
    )
    dropped_samples: int = 0


ConfigT = TypeVar("ConfigT", bound=PolicyJobConfig)
"""The run's config: ``grpo``'s, or a command's that runs this job with its own algorithm (``ppo``)."""


class GRPOTrainer(TrainingJob[GRPOResult], Generic[ConfigT]):
    """Group-relative policy optimisation with an exact-answer reward.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.grpo.config.load_config`).
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints``.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over.
    """

    command = "grpo"
    result_type = GRPOResult
    curve_file = CURVE_FILE

    config: ConfigT

    def _data_order(self) -> dict[str, int]:
        trainer = self.config.trainer
        return {
            "trainer.seed": trainer.seed,
            "trainer.prompts_per_step": trainer.prompts_per_step,
            "rollout.n": self.config.rollout.n,
        }

    def _global_batch(self) -> tuple[str, int]:
        return ("trainer.prompts_per_step", self.config.trainer.prompts_per_step)

    def _setup(self) -> Engine:
        """The start policy, the prompts, the actor, the reference and the rollout."""
        config = self.config
        check_mini_batch_share(config, distributed.world_size())
        # A missing rollout is refused before the warm start, and so are options or router replay it cannot take ...
        require_rollout(config.rollout, config.engine)
        # ... and so is a reward function that does not load.
        load_rewards(config.algorithm.rewards())
        self.model_path = start_model(config, self.output_dir, resume=self.folder.resume)
        self.tokenizer, self.train, self.val = load_splits(
            self.model_path,
            config.data,
            self.output_dir,
            config.trainer.seed,
            resume=self.folder.resume,
            trust_remote_code=config.model.trust_remote_code,
            task=data_task(config.model.path),
        )
        check_rollout_length(self.train + self.val, config, self.model_path)
        check_reward_inputs(config.algorithm.rewards(), self.train + self.val)
        warn_unreachable_answers(self.train, config.rollout.max_new_tokens, self.tokenizer.eos_token_id)
        self.folder = self.folder.for_data(e.token_ids for e in self.train)
        self.actor = self.make_actor(self.model_path)
        self.reference = self.make_reference(self.actor, self.model_path)
        self.rollout = build_rollout(config.rollout, self.model_path, config.engine.device)
        self.sampler = StepSampler(
            len(self.train),
            config.trainer.prompts_per_step,
            config.trainer.seed,
            setting="trainer.prompts_per_step",
        )
        return self.actor.engine

    def _engine(self, model_path: str, *, train: bool) -> Engine:
        from drivetrain_engine_core.factory import create_engine

        engine = create_engine(
            model_config=dataclasses.replace(self.config.model, path=model_path),
            engine_config=self.config.engine,
            optimizer_config=self.config.run_optimizer() if train else None,
            checkpoint_config=self.config.checkpoint,
        )
        engine.initialize()
        return engine

    def make_actor(self, model_path: str) -> Actor:
        """The actor: a training engine of ``model_path`` with the GRPO loss, one optimizer step per rollout.

        Raises:
            ConfigError: some rank would hold no outputs (model parallelism; see :mod:`..output_ranks`).
        """
        engine = self._engine(model_path, train=True)
        require_outputs_on_every_rank(engine, "drivetrain grpo")
        return Actor(engine, actor_config(self.config))

    def make_reference(self, actor: Actor, model_path: str) -> Reference | None:
        """The KL reference: the actor's base model with LoRA, else its own inference-only engine; ``None``
        without a KL penalty."""
        if not self._uses_reference():
            return None
        temperature = self.config.rollout.temperature
        if self.config.model.lora is not None:
            return Reference(actor.engine, use_actor_base=True, temperature=temperature)
        return Reference(self._engine(model_path, train=False), temperature=temperature)

    def run(self) -> GRPOResult:
        try:
            return super().run()
        finally:
            pipeline = getattr(self, "pipeline", None)
            if pipeline is not None:
                pipeline.close()

    def _uses_reference(self) -> bool:
        """Whether a KL term reads the reference's log-probs (GRPO: the KL loss)."""
        return self.config.algorithm.kl_loss_coef != 0

    def _start_step(self, engine: Engine) -> int:
        step = super()._start_step(engine)
        if step:
            # One policy update per step: the mini-batch shuffle continues its sequence; the rollout serves
            # the resumed weights.
            self.actor.updates_done = step
            rollout = self.config.rollout
            hand_off(self.actor, self.rollout, step, rollout.bucket_mb, rollout.lora_handoff)
        # NOTE: a resumed run generates from its checkpoint's step on: batches generated ahead of a checkpoint
        # were never trained (the checkpoint's step says which were), so none is trained twice or skipped.
        self.pipeline = RolloutPipeline(
            self.rollout,
            self._request,
            version=step,
            first=step,
            last=self.config.trainer.total_steps,
            lag=generation_lag(self.config.trainer),
        )
        return step

    # ------------------------------------------------------------------ loop

    def _examples(self, step: int) -> list[Example]:
        """This rank's prompts of ``step``: a function of the step alone, whenever they are generated."""
        engine = self.actor.engine
        local = self.sampler.local_indices(step, engine.data_parallel_rank, engine.data_parallel_size)
        return [self.train[i] for i in local]

    def _request(self, step: int) -> tuple[list[list[int]], SamplingConfig]:
        """The prompts and sampling of ``step``'s batch (called on the rollout thread in async modes)."""
        seed = self.config.trainer.seed + SEED_STRIDE * step + distributed.rank()
        return [e.prompt_ids for e in self._examples(step)], sampling_config(self.config, seed=seed)

    # NOTE: GRPO's own step (its scoring reads GRPO's group filter); a job on another config overrides it.
    def _step(self: GRPOTrainer[GRPOConfig], step: int, result: GRPOResult) -> dict[str, float]:
        engine, config = self.actor.engine, self.config
        started = time.perf_counter()
        generated = self.pipeline.take(step)
        taken = time.perf_counter()
        versions = Versions.of(
            generated.output,
            generated.version,
            current=step,
            max_staleness=generation_lag(config.trainer),
        )
        samples = score_agreed(
            self._examples(step),
            generated.output,
            self.tokenizer,
            config,
            engine.data_parallel_group,
            versions=versions,
        )
        metrics = update(self.actor, self.reference, samples)
        sync = self.pipeline.update(
            lambda: hand_off(
                self.actor, self.rollout, step + 1, config.rollout.bucket_mb, config.rollout.lora_handoff
            ),
            step + 1,
        )
        ended = time.perf_counter()
        seconds = ended - started
        timing = {
            "generating": generated.seconds,
            "training": ended - taken,
            "overlapped": self.pipeline.overlap(taken, ended),
        }
        for name, value in timing.items():
            result.timing[name] += value
        group = engine.data_parallel_group
        reward_sum, count, response_tokens, tokens, filtered = distributed.all_reduce_sums(
            [
                float(samples.rewards.sum()),
                len(samples.rewards),
                sum(samples.response_lengths),
                int(samples.batch["input_ids"].values().numel()),
                samples.filtered_groups,
            ],
            group,
        )
        values = {
            "train/reward": reward_sum / count,
            **reward_metrics(samples.scores, group),
            "train/pg_loss": metrics["pg_loss"],
            "train/clip_fraction": metrics["pg_clipfrac"],
            "train/entropy": metrics["entropy"],
            "train/grad_norm": metrics["grad_norm"],
            "train/lr": metrics["lr"],
            "train/response_length": response_tokens / count,
            "rollout/log_prob_diff_max": metrics["rollout/log_prob_diff_max"],
            "rollout/mismatch_kl": metrics["rollout/mismatch_kl"],
            "perf/step_time_s": seconds,
            "perf/tokens_per_s": tokens / seconds,
            "perf/wait_s": taken - started,
            **{f"perf/{name}_s": value for name, value in timing.items()},
        }
        if config.trainer.mode != "sync":
            staleness = staleness_metrics(
                versions, dropped_sequences=samples.dropped_groups * config.rollout.n, group=group
            )
            values.update(staleness)
            result.dropped_samples += int(staleness["async/dropped_samples"])
        if "rollout_is_weight" in metrics:
            values["train/rollout_is_weight"] = metrics["rollout_is_weight"]
            values["train/rollout_is_capped"] = metrics["rollout_is_capped"]
        if "kl_loss" in metrics:
            values["train/kl"] = metrics["kl_loss"]
        values.update({f"train/{name}": metrics[name] for name in ENGINE_LOSS_METRICS if name in metrics})
        if config.algorithm.filter_groups:
            values["train/filtered_group_fraction"] = filtered * config.rollout.n / count
        values.update(sync)
        result.rewards.append(values["train/reward"])
        return values

    def _evaluate(self, step: int) -> dict[str, float]:
        """Greedy answers to the first ``trainer.eval_samples`` held-out prompts: ``val/accuracy`` (exact answers;
        none without references, ``data.response_key=null``) and ``val/reward`` (the mean reward, the same number
        with ``exact_match`` alone)."""
        config = self.config
        samples = self.val[: config.trainer.eval_samples]
        if not samples:
            return {}
        rank, size = distributed.rank(), distributed.world_size()
        local = samples[rank::size]
        correct, reward = 0.0, 0.0
        with agreed_checks():
            if local:
                sampling = SamplingConfig(temperature=0.0, max_new_tokens=config.rollout.max_new_tokens)
                with self.pipeline.exclusive() as rollout:
                    output = rollout.generate([e.prompt_ids for e in local], sampling)
                answers, scores = answer_rewards(local, output, self.tokenizer, config.algorithm.rewards())
                correct = sum(exact_match(a, e.response_text) for a, e in zip(answers, local, strict=True))
                reward = float(scores.total.sum())
        correct, reward = distributed.all_reduce_sums([correct, reward])
        accuracy = {"val/accuracy": correct / len(samples)} if samples[0].has_reference else {}
        return {**accuracy, "val/reward": reward / len(samples)}

    def _postfix(self, values: dict[str, float]) -> dict[str, str]:
        return _postfix(values)

    # ------------------------------------------------------------------ end

    def _save_final(self, engine: Engine, target: Path) -> None:
        save_final_model(
            engine, self.model_path, self.tokenizer, target, max_new_tokens=self.config.rollout.max_new_tokens
        )

    def _finish(self, result: GRPOResult, loop_seconds: float) -> None:
        result.seconds = loop_seconds

    def _plot(self, records: list[dict[str, Any]]) -> None:
        plot_curves(
            records,
            self.output_dir / self.curve_file,
            left=[("train/reward", f"train reward ({self.config.algorithm.rewards().label})", "-")],
            left_label="mean reward",
        )

    def _summary(self, result: GRPOResult) -> dict[str, Any]:
        return {
            "start_step": result.start_step,
            "final_train_reward": result.rewards[-1] if result.rewards else None,
            "evaluations": result.evaluations,
            "seconds": result.seconds,
            "mode": self.config.trainer.mode,
            "timing_seconds": result.timing,
            "dropped_samples": result.dropped_samples,
        }

    def _report_lines(self, result: GRPOResult) -> list[str]:
        lines = [f"run directory: {result.output_dir}"]
        if not result.evaluations:
            return lines
        first, last = result.evaluations[0], result.evaluations[-1]
        if "val/accuracy" in last:
            lines.append(
                f"val/accuracy: {first['val/accuracy']:.4f} (step {first['step']}) -> {last['val/accuracy']:.4f} "
                f"(step {last['step']}) in {result.seconds:.0f} s of {self.command.upper()}"
            )
        label = self.config.algorithm.rewards().label
        if label != EXACT_MATCH or "val/accuracy" not in last:  # else the same numbers
            lines.append(
                f"val/reward: {first['val/reward']:.4f} (step {first['step']}) -> {last['val/reward']:.4f} "
                f"(step {last['step']}, {label})"
            )
        return lines


def _postfix(values: dict[str, float]) -> dict[str, str]:
    """The progress bar's reward, KL and tokens/s."""
    return {
        "reward": f"{values['train/reward']:.3f}",
        "kl": f"{values.get('train/kl', 0.0):.4f}",
        "tok_s": f"{values['perf/tokens_per_s']:.0f}",
    }
