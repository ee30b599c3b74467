"""The policy job ``grpo`` and ``ppo`` share: one template that owns setup and the step's sequence.

One process per rank (``torchrun`` or ``drivetrain <command> --nproc N``). Setup: the start policy (a model
directory, or the embedded job's SFT warm start), the prompts, the actor engine, the reference (its own
inference-only engine, or the actor's base model with LoRA; none when no KL term reads it), the rollout
(``rollout.name``) and the scorer. Each step, :meth:`PolicyTrainer._step`: **sample** (the
:class:`~.hooks.Sampler`: generation in step or ahead of it, ``trainer.mode``: :mod:`.pipeline`), **score** (the
:class:`~.hooks.Scorer`: the reward functions, :mod:`.scoring`), the command's batch and **update** (its hooks),
the weight **hand-off**, then one record (:class:`~.step_record.StepRecord`) that the command adds its own
metrics to. Held-out greedy answers (through the rollout, i.e. the synced weights: :mod:`.held_out`) before the
first step, every ``trainer.eval_every`` steps and after the last; checkpoints in ``<run>/checkpoints``;
``resume`` continues from the latest one (the rollout is synced from it first); the run ends with
``final_model``.

A command subclasses :class:`PolicyTrainer` and fills in :meth:`~PolicyTrainer._batch`,
:meth:`~PolicyTrainer._update`, :meth:`~PolicyTrainer._uses_reference` and
:meth:`~PolicyTrainer._command_metrics`; a new sampler or scorer is returned by :meth:`~PolicyTrainer.make_sampler`
or :meth:`~PolicyTrainer.make_scorer`, with no change to the commands.
"""

from __future__ import annotations

import dataclasses
import time
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import agreed_checks, environment_factory
from drivetrain_engine_core.kit import distributed
from drivetrain_engine_core.rollout import SamplingConfig

from ..actor import Actor
from ..jobs.assets import load_splits
from ..jobs.batches import StepSampler
from ..jobs.builtin_tasks import data_task
from ..jobs.curves import Panel
from ..jobs.data import Example
from ..jobs.final_model import save_final_model
from ..jobs.job import JobResult, TrainingJob
from ..output_ranks import require_outputs_on_every_rank
from ..reference import Reference
from ..reward_model.build import make_reward_models
from .actor_setup import actor_config
from .batch import RolloutBatch
from .curves import POLICY_CURVES, reward_entries_panel
from .episodes import EpisodeBatch, EpisodePipeline
from .held_out import held_out_evaluation
from .hooks import Sampler, Scorer
from .job_config import PolicyJobConfig, check_mini_batch_share
from .pipeline import GeneratedBatch, RolloutPipeline
from .prompt_checks import check_rollout_length, warn_unreachable_answers
from .rewards import EXACT_MATCH, Scores, check_reward_inputs, load_rewards
from .rollout_plugin import build_rollout, require_rollout
from .sampling import SEED_STRIDE, hand_off, sampling_config
from .scoring import RewardScorer
from .step_record import StepRecord
from .trainer_config import generation_lag
from .warm_start import start_model

CURVE_FILE = "reward_curve.png"


@dataclass
class PolicyJobResult(JobResult):
    """What a run did, on every rank (see :class:`~drivetrain_roles.jobs.job.JobResult`).

    Attributes:
        rewards: mean training reward of each step this process ran.
        seconds: wall time of the training loop (warm start and setup excluded).
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


@dataclass(frozen=True)
class StepTiming:
    """Where a step's seconds went (this process).

    Attributes:
        wait: waiting for the step's responses.
        generating: the rollout generating them (ahead of the step, in an asynchronous mode).
        training: from the responses to the end of the hand-off.
        overlapped: generation that ran while this step trained.
    """

    wait: float
    generating: float
    training: float
    overlapped: float


ConfigT = TypeVar("ConfigT", bound=PolicyJobConfig)
"""The run's config: a command's (``grpo``'s, ``ppo``'s) with the sections :class:`PolicyJobConfig` names."""


class PolicyTrainer(TrainingJob[PolicyJobResult], Generic[ConfigT]):
    """A job that samples from its policy, scores the samples and trains the policy on them.

    Args:
        config: the run's configuration.
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints``.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over.
    """

    result_type = PolicyJobResult
    curve_file = CURVE_FILE
    curves = POLICY_CURVES

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
        """The start policy, the prompts, the actor, the reference, the rollout and the scorer."""
        config = self.config
        check_mini_batch_share(config, distributed.world_size())
        # A missing rollout is refused before the warm start, and so are options or router replay it cannot take ...
        require_rollout(config.rollout, config.engine, config.trainer)
        # ... and so is a reward function that does not load.
        load_rewards(config.algorithm.rewards())
        # ... and so is an environment that is not registered or does not take its options.
        if config.environment.name is not None:
            environment_factory(config.environment.name, config.environment.options)
        self.model_path = start_model(config, self.output_dir, resume=self.folder.resume)
        self._load_prompts()
        self.actor = self.make_actor(self.model_path)
        self.reference = self.make_reference(self.actor, self.model_path)
        self.reward_models = make_reward_models(config, len(self.val), distributed.world_size())
        self.rollout = build_rollout(config.rollout, self.model_path, config.engine.device, config.trainer)
        self.scorer = self.make_scorer()
        self.sampler = StepSampler(
            len(self.train),
            config.trainer.prompts_per_step,
            config.trainer.seed,
            setting="trainer.prompts_per_step",
        )
        return self.actor.engine

    def _load_prompts(self) -> None:
        """The tokenizer and the train and held-out prompts of the start policy, checked against the rollout's
        length and the reward functions' keywords; the run folder told what the data is."""
        config = self.config
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
        rewards, episodes = config.algorithm.rewards(), config.environment.enabled
        check_reward_inputs(rewards, self.train + self.val, episodes=episodes)
        warn_unreachable_answers(self.train, config.rollout.max_new_tokens, self.tokenizer.eos_token_id)
        self.folder = self.folder.for_data(e.token_ids for e in self.train)

    def _engine(self, model_path: str, *, train: bool) -> Engine:
        from drivetrain_engine_core.job import create_engine

        engine = create_engine(
            model_config=dataclasses.replace(self.config.model, path=model_path),
            engine_config=self.config.engine,
            optimizer_config=self.config.run_optimizer() if train else None,
            checkpoint_config=self.config.checkpoint,
        )
        engine.initialize()
        return engine

    def make_actor(self, model_path: str) -> Actor:
        """The actor: a training engine of ``model_path`` with the policy loss, one optimizer step per rollout.

        Raises:
            ConfigError: some rank would hold no outputs (model parallelism; see :mod:`..output_ranks`).
        """
        engine = self._engine(model_path, train=True)
        require_outputs_on_every_rank(engine, f"drivetrain {self.command}")
        return Actor(engine, actor_config(self.config))

    def make_reference(self, actor: Actor, model_path: str) -> Reference | None:
        """The KL reference: the actor's base model with LoRA, else its own inference-only engine; ``None``
        when no KL term reads it."""
        if not self._uses_reference():
            return None
        temperature = self.config.rollout.temperature
        if self.config.model.lora is not None:
            return Reference(actor.engine, use_actor_base=True, temperature=temperature)
        return Reference(self._engine(model_path, train=False), temperature=temperature)

    def make_scorer(self) -> Scorer:
        """What scores a step's responses: the reward functions of ``algorithm.rewards()``, its reward models
        those built at set-up (``self.reward_models``)."""
        return RewardScorer(self.config.algorithm.rewards(), self.tokenizer, self.reward_models)

    def make_sampler(self, step: int) -> Sampler:
        """What generates the steps ``step .. trainer.total_steps - 1`` from the rollout serving version ``step``:
        in step (``trainer.mode=sync``) or ahead of it on a thread; as episodes in ``environment.name``, when set."""
        config = self.config
        window: dict[str, Any] = {
            "version": step,
            "first": step,
            "last": config.trainer.total_steps,
            "lag": generation_lag(config.trainer),
        }
        if config.environment.enabled:  # episodes in the environment, from each example's row
            return EpisodePipeline.configured(
                config.environment,
                self.rollout,
                self._request,
                rows=self._rows,
                tokenizer=self.tokenizer,
                **window,
            )
        return RolloutPipeline(self.rollout, self._request, **window)

    def run(self) -> PolicyJobResult:
        try:
            return super().run()
        finally:
            pipeline = getattr(self, "pipeline", None)
            if pipeline is not None:
                pipeline.close()

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
        self.pipeline = self.make_sampler(step)
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

    def _rows(self, step: int) -> list[Mapping[str, Any]]:
        """The data set rows of ``step``'s prompts, as episodes start from them (``Environment.reset``)."""
        return [e.columns for e in self._examples(step)]

    def _step(self, step: int, result: PolicyJobResult) -> dict[str, float]:
        """Sample, score, update, hand off; then the step's record and the command's own metrics."""
        started = time.perf_counter()
        generated = self.pipeline.take(step)
        taken = time.perf_counter()
        samples = self._score(step, generated)
        update = self._update(step, samples)
        sync = self.pipeline.update(lambda: self._hand_off(step), step + 1)
        ended = time.perf_counter()
        timing = StepTiming(
            wait=taken - started,
            generating=generated.seconds,
            training=ended - taken,
            overlapped=self.pipeline.overlap(taken, ended),
        )
        group = self.actor.engine.data_parallel_group
        record = StepRecord.measure(samples, update, seconds=ended - started, group=group)
        values = {
            **record.values(),
            **self._command_metrics(record, samples, timing, result),
            **generated.metrics(group),
            **sync,
        }
        result.rewards.append(values["train/reward"])
        return values

    def _score(self, step: int, generated: GeneratedBatch) -> RolloutBatch:
        """Score this rank's responses of ``step`` (collective: a scorer failing on one rank raises the same error
        on every rank) and build the command's batch from them."""
        examples = self._examples(step)
        with agreed_checks():
            if isinstance(generated, EpisodeBatch):  # the functions' trajectory keyword
                scores = self.scorer(examples, generated.output, generated.trajectories)
            else:
                scores = self.scorer(examples, generated.output)
        return self._batch(step, examples, generated, scores)

    def _hand_off(self, step: int) -> Mapping[str, float]:
        """Stream the actor's weights to the rollout as version ``step + 1`` (collective); the sync's metrics."""
        rollout = self.config.rollout
        return hand_off(self.actor, self.rollout, step + 1, rollout.bucket_mb, rollout.lora_handoff)

    # ------------------------------------------------------------------ the command's hooks

    @abstractmethod
    def _uses_reference(self) -> bool:
        """Whether a KL term reads the reference's log-probs (setup builds the reference only then)."""

    @abstractmethod
    def _batch(
        self, step: int, examples: list[Example], generated: GeneratedBatch, scores: Scores
    ) -> RolloutBatch:
        """The actor's batch of ``step`` from this rank's ``examples``, their ``generated`` responses and
        ``scores``: which responses are in the loss, their rewards and advantages."""

    @abstractmethod
    def _update(self, step: int, samples: RolloutBatch) -> dict[str, float]:
        """Train on ``samples`` (collective); returns the update's metrics (see :class:`~.step_record.StepRecord`)."""

    @abstractmethod
    def _command_metrics(
        self, record: StepRecord, samples: RolloutBatch, timing: StepTiming, result: PolicyJobResult
    ) -> dict[str, float]:
        """The command's own metrics of a step beside ``record``'s (collective where they reduce); notes what
        ``result`` keeps of them."""

    # ------------------------------------------------------------------ evaluation and end

    def _evaluate(self, step: int) -> dict[str, float]:
        """Greedy answers (or episodes) to the first ``trainer.eval_samples`` held-out prompts, scored as in
        training: ``val/accuracy``, ``val/reward`` and ``val/reward/<name>`` (:mod:`.held_out`)."""
        samples = self.val[: self.config.trainer.eval_samples]
        return held_out_evaluation(samples, self.pipeline, self.tokenizer, self.config, self.reward_models)

    def _postfix(self, values: dict[str, float]) -> dict[str, str]:
        """The progress bar's reward, KL and tokens/s."""
        return {
            "reward": f"{values['train/reward']:.3f}",
            "kl": f"{values.get('train/kl', 0.0):.4f}",
            "tok_s": f"{values['perf/tokens_per_s']:.0f}",
        }

    def _save_final(self, engine: Engine, target: Path) -> None:
        save_final_model(
            engine, self.model_path, self.tokenizer, target, max_new_tokens=self.config.rollout.max_new_tokens
        )

    def _finish(self, result: PolicyJobResult, loop_seconds: float) -> None:
        result.seconds = loop_seconds

    def _curve_fields(self) -> dict[str, str]:
        return {"reward": self.config.algorithm.rewards().label}

    def _curve_panels(self) -> tuple[Panel, ...]:
        return (reward_entries_panel(self.config.algorithm.rewards().names),)

    def _summary(self, result: PolicyJobResult) -> dict[str, Any]:
        return {
            "start_step": result.start_step,
            "final_train_reward": result.rewards[-1] if result.rewards else None,
            "evaluations": result.evaluations,
            "seconds": result.seconds,
            "mode": self.config.trainer.mode,
            "timing_seconds": result.timing,
            "dropped_samples": result.dropped_samples,
        }

    def _report_lines(self, result: PolicyJobResult) -> list[str]:
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
