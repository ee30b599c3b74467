"""The GRPO training loop over any installed engine backend and rollout.

One process per rank (``torchrun`` or ``drivetrain grpo --nproc N``). Setup: the start policy (a model
directory, or the embedded job's SFT warm start), the actor engine, the reference (its own inference-only
engine, or the actor's base model with LoRA; none when ``algorithm.kl_loss_coef`` is 0) and the rollout
(``rollout.name``). Each step (:mod:`.step`): sample and reward this rank's prompts, one PPO-clip update,
weight hand-off. Held-out greedy accuracy (through the rollout, i.e. the synced weights) before the first
step, every ``trainer.eval_every`` steps and after the last; checkpoints in ``<run>/checkpoints``; ``resume``
continues from the latest one (the rollout is synced from it first); the run ends with ``final_model``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivetrain_engine_core import distributed
from drivetrain_engine_core.agreement import agreed_checks
from drivetrain_engine_core.checkpoint.durable import write_durably
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.data.values import TokenLimits
from drivetrain_engine_core.engine import Engine
from drivetrain_engine_core.plugins import plugins
from drivetrain_engine_core.rollout import Rollout, SamplingConfig, create_rollout

from ..actor import Actor, ActorConfig
from ..jobs.assets import load_splits
from ..jobs.batches import StepSampler
from ..jobs.data import Example
from ..jobs.final_model import FINAL_MODEL_DIR, save_final_model
from ..jobs.launch import SUMMARY_FILE
from ..jobs.metrics import MetricsWriter, format_record, plot_curves
from ..jobs.run_folder import RunFolder, begin_run
from ..jobs.step_loop import StepLoop
from ..mini_batches import UpdateSchedule
from ..output_ranks import require_outputs_on_every_rank
from ..reference import Reference
from ..runtime.command_config import to_plain
from ..runtime.tracking.jsonl import dumps
from .config import GRPOConfig, check_mini_batch_share
from .rewards import exact_match, load_reward_function
from .step import SEED_STRIDE, answer_rewards, hand_off, sample, update
from .warm_start import start_model

logger = logging.getLogger(__name__)
CURVE_FILE = "reward_curve.png"


def actor_config(config: GRPOConfig) -> ActorConfig:
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
class GRPOResult:
    """What a run did, on every rank.

    Attributes:
        output_dir: the run directory.
        start_step: 0, or the resumed checkpoint's step.
        rewards: mean training reward of each step this process ran.
        evaluations: ``{"step", "val/accuracy"}`` of each evaluation of the run (a resumed run's earlier
            ones from ``metrics.jsonl``).
        seconds: wall time of the GRPO loop (warm start and setup excluded).
    """

    output_dir: Path
    start_step: int
    rewards: list[float] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


class GRPOTrainer:
    """Group-relative policy optimisation with an exact-answer reward.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.grpo.config.load_config`).
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints``.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over.
    """

    def __init__(
        self, config: GRPOConfig, output_dir: str | Path, *, resume: bool = False, overwrite: bool = False
    ) -> None:
        self.config = config
        self.output_dir = Path(output_dir)
        trainer = config.trainer
        self.folder = RunFolder(
            path=self.output_dir,
            resume=resume,
            overwrite=overwrite,
            data_order={
                "trainer.seed": trainer.seed,
                "trainer.prompts_per_step": trainer.prompts_per_step,
                "rollout.n": config.rollout.n,
            },
        )

    def run(self) -> GRPOResult:
        """Train for ``trainer.total_steps`` steps; returns this process's rewards and the run's evaluations."""
        config = self.config
        begin_run(
            self.folder,
            config,
            engine=config.engine,
            trainer=config.trainer,
            batch=("trainer.prompts_per_step", config.trainer.prompts_per_step),
        )
        check_mini_batch_share(config, distributed.world_size())
        plugins().rollouts.get(config.rollout.name)  # a missing rollout is refused before the warm start
        # ... and so is a reward function that does not load.
        load_reward_function(config.algorithm.reward_function)
        model_path = start_model(config, self.output_dir, resume=self.folder.resume)
        tokenizer, train, val = load_splits(
            model_path,
            self.config.data,
            self.output_dir,
            self.config.trainer.seed,
            resume=self.folder.resume,
            trust_remote_code=config.model.trust_remote_code,
        )
        check_rollout_length(train + val, config, model_path)
        warn_unreachable_answers(train, config.rollout.max_new_tokens, tokenizer.eos_token_id)
        self.folder = self.folder.for_data(e.token_ids for e in train)
        actor = self.make_actor(model_path)
        reference = self.make_reference(actor, model_path)
        rollout = create_rollout(config.rollout.name, model_path=model_path, device=config.engine.device)
        start_step = self._maybe_resume(actor, rollout)
        writer = MetricsWriter(
            self.output_dir,
            enabled=distributed.rank() == 0,
            report_to=config.trainer.report_to,
            config=to_plain(config),
            resume_step=start_step if self.folder.resume else None,
        )
        result = GRPOResult(
            output_dir=self.output_dir, start_step=start_step, evaluations=writer.earlier_evaluations()
        )
        loop = _Loop(self, actor, reference, rollout, tokenizer, train, val, writer, result)
        started = time.perf_counter()
        loop.run()
        result.seconds = time.perf_counter() - started
        save_final_model(
            actor.engine,
            model_path,
            tokenizer,
            self.output_dir / FINAL_MODEL_DIR,
            max_new_tokens=config.rollout.max_new_tokens,
        )
        if distributed.rank() == 0:
            plot_curves(
                writer.records,
                self.output_dir / CURVE_FILE,
                left=[("train/reward", "train reward (exact answers)", "-")],
                left_label="mean reward",
            )
            _write_summary(self.output_dir, result, to_plain(config))
        return result

    # ------------------------------------------------------------------ setup

    def _engine(self, model_path: str, *, train: bool) -> Engine:
        from drivetrain_engine_core.factory import create_engine

        engine = create_engine(
            model_config=dataclasses.replace(self.config.model, path=model_path),
            engine_config=self.config.engine,
            optimizer_config=self.config.optimizer if train else None,
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
        if self.config.algorithm.kl_loss_coef == 0:
            return None
        temperature = self.config.rollout.temperature
        if self.config.model.lora is not None:
            return Reference(actor.engine, use_actor_base=True, temperature=temperature)
        return Reference(self._engine(model_path, train=False), temperature=temperature)

    def _maybe_resume(self, actor: Actor, rollout: Rollout) -> int:
        step = self.folder.start_step(actor.engine)
        if step:
            # One policy update per step: the mini-batch shuffle continues its sequence; the rollout serves
            # the resumed weights.
            actor.updates_done = step
            hand_off(actor, rollout, step, self.config.rollout.bucket_mb)
        return step


@dataclass
class _Loop:
    """The steps of one run, with evaluation, metrics and checkpoints."""

    trainer: GRPOTrainer
    actor: Actor
    reference: Reference | None
    rollout: Rollout
    tokenizer: Any
    train: list[Example]
    val: list[Example]
    writer: MetricsWriter
    result: GRPOResult

    def run(self) -> None:
        config = self.trainer.config.trainer
        sampler = StepSampler(
            len(self.train), config.prompts_per_step, config.seed, setting="trainer.prompts_per_step"
        )
        StepLoop("grpo", config, self.trainer.folder, self.writer).run(
            self.actor.engine,
            self.result.start_step,
            step=lambda step: self._step(step, sampler),
            evaluate=self._evaluate,
            postfix=_postfix,
        )

    def _step(self, step: int, sampler: StepSampler) -> dict[str, float]:
        engine, config = self.actor.engine, self.trainer.config
        local = sampler.local_indices(step, engine.data_parallel_rank, engine.data_parallel_size)
        started = time.perf_counter()
        seed = config.trainer.seed + SEED_STRIDE * step + distributed.rank()
        examples = [self.train[i] for i in local]
        samples = sample(
            self.rollout, examples, self.tokenizer, config, seed=seed, group=engine.data_parallel_group
        )
        metrics = update(self.actor, self.reference, samples)
        sync = hand_off(self.actor, self.rollout, step + 1, config.rollout.bucket_mb)
        seconds = time.perf_counter() - started
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
            "train/pg_loss": metrics["pg_loss"],
            "train/clip_fraction": metrics["pg_clipfrac"],
            "train/entropy": metrics["entropy"],
            "train/grad_norm": metrics["grad_norm"],
            "train/lr": metrics["lr"],
            "train/response_length": response_tokens / count,
            "rollout/log_prob_diff_max": metrics["rollout/log_prob_diff_max"],
            "perf/step_time_s": seconds,
            "perf/tokens_per_s": tokens / seconds,
        }
        if "kl_loss" in metrics:
            values["train/kl"] = metrics["kl_loss"]
        if config.algorithm.filter_groups:
            values["train/filtered_group_fraction"] = filtered * config.rollout.n / count
        values.update(sync)
        self.result.rewards.append(values["train/reward"])
        return values

    def _evaluate(self, step: int, bar: Any) -> None:
        """Greedy answers to the first ``trainer.eval_samples`` held-out prompts: ``val/accuracy`` (exact answers)
        and ``val/reward`` (the mean of ``algorithm.reward_function``, the same number with ``exact_match``)."""
        config = self.trainer.config
        samples = self.val[: config.trainer.eval_samples]
        if not samples:
            return
        rank, size = distributed.rank(), distributed.world_size()
        local = samples[rank::size]
        correct, reward = 0.0, 0.0
        with agreed_checks():
            if local:
                sampling = SamplingConfig(temperature=0.0, max_new_tokens=config.rollout.max_new_tokens)
                output = self.rollout.generate([e.prompt_ids for e in local], sampling)
                answers, rewards = answer_rewards(
                    local, output, self.tokenizer, config.algorithm.reward_function
                )
                correct = sum(exact_match(a, e.response_text) for a, e in zip(answers, local, strict=True))
                reward = float(rewards.sum())
        correct, reward = distributed.all_reduce_sums([correct, reward])
        values = {"val/accuracy": correct / len(samples), "val/reward": reward / len(samples)}
        self.writer.write(step, values)
        self.result.evaluations.append({"step": step, **values})
        if rank == 0:
            bar.write(f"[step {step}] {format_record(values)}")


def _postfix(values: dict[str, float]) -> dict[str, str]:
    """The progress bar's reward, KL and tokens/s."""
    return {
        "reward": f"{values['train/reward']:.3f}",
        "kl": f"{values.get('train/kl', 0.0):.4f}",
        "tok_s": f"{values['perf/tokens_per_s']:.0f}",
    }


def warn_unreachable_answers(examples: list[Example], max_new_tokens: int, eos_token_id: int | None) -> None:
    """Warn (rank 0) when reference answers are longer than a response may be: the exact-answer reward of their
    prompts is 0 whatever the policy does (``rollout.max_new_tokens`` is 6 for the embedded job's sums, and a
    user's model keeps it unless set)."""
    lengths = [len(e.response_ids) - (e.response_ids[-1:] == [eos_token_id]) for e in examples]
    unreachable = sum(length > max_new_tokens for length in lengths)
    if unreachable and distributed.rank() == 0:
        logger.warning(
            "%d of %d training answers are longer than rollout.max_new_tokens=%d tokens (the longest has %d): their "
            "prompts can never earn reward 1. Raise rollout.max_new_tokens.",
            unreachable,
            len(examples),
            max_new_tokens,
            max(lengths),
        )


def check_rollout_length(examples: list[Example], config: GRPOConfig, model_path: str) -> None:
    """The longest prompt plus ``rollout.max_new_tokens`` must fit the model's positions and, with dynamic
    batching, one micro-batch: checked when the prompts load, not at the step whose sample first grows that
    long (a ``BatchError`` hours into a run).

    Raises:
        ConfigError: the longest possible sequence exceeds either limit (names both settings).
    """
    from transformers import AutoConfig

    longest = max((len(e.prompt_ids) for e in examples), default=0) + config.rollout.max_new_tokens
    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    positions = TokenLimits.from_hf_config(hf_config, model_path).max_positions
    budget = config.engine.micro_batch.max_tokens
    for limit, setting in (
        (positions, f"the model's max_position_embeddings={positions}"),
        (budget, f"engine.micro_batch.max_tokens={budget}"),
    ):
        if limit is not None and longest > limit:
            raise ConfigError(
                f"the longest prompt plus rollout.max_new_tokens={config.rollout.max_new_tokens} is {longest} "
                f"tokens, over {setting}; lower rollout.max_new_tokens or data.max_length (which bounds the "
                "prompts), or raise the limit."
            )


def _write_summary(output_dir: Path, result: GRPOResult, config: dict[str, Any]) -> None:
    summary = {
        "start_step": result.start_step,
        "final_train_reward": result.rewards[-1] if result.rewards else None,
        "evaluations": result.evaluations,
        "seconds": result.seconds,
        "final_model": str(output_dir / FINAL_MODEL_DIR),
        "config": config,
    }
    write_durably(output_dir / SUMMARY_FILE, dumps(summary, indent=2))
