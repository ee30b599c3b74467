"""The SFT training loop over any installed engine backend.

One process per rank (``torchrun`` or ``drivetrain sft --nproc N``); every rank runs this loop, the engine
shards the work, and the output rank writes metrics. Per step: this rank's share of the global batch ->
``engine.train_batch`` with the SFT loss -> one LR-schedule step. Held-out loss (and perplexity) and greedy
accuracy are measured before the first step, every ``trainer.eval_every`` steps and after the last, and the
report leads with the one that fits the data (:mod:`.headline`); checkpoints go to
``<output_dir>/checkpoints`` every ``trainer.save_every`` steps and at the end, and ``resume=True`` continues
from the latest one with the same data order, so a resumed run reproduces the uninterrupted one exactly (from
the ``model.path`` it started from: another one's tokenizer and config would be saved with the trained weights).
The run directory also holds the resolved ``config.yaml`` and, at the end, the trained model as a plain
Hugging Face folder (``final_model``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import ConfigError, Engine

from ..held_out_metrics import HeldOutMetrics
from ..jobs.assets import load_splits, resolve_model_path
from ..jobs.batches import StepSampler, check_held_out_size, make_sft_batch
from ..jobs.builtin_tasks import data_task
from ..jobs.curves import Panel
from ..jobs.data import DataError, Example
from ..jobs.evaluate import greedy_evaluation, held_out_loss
from ..jobs.final_model import save_final_model
from ..jobs.job import JobResult, TrainingJob, evaluation_lines
from ..jobs.metrics import step_record
from ..jobs.resume_start import check_or_record_start
from ..losses.sft import sft_loss_fn
from .config import SFTConfig
from .headline import CURVES, REPORT_KEYS, headline, perplexity

logger = logging.getLogger(__name__)


@dataclass
class SFTResult(JobResult):
    """What a run did, on every rank (see :class:`~drivetrain_roles.jobs.job.JobResult`).

    Attributes:
        train_losses: the training loss of each step this process ran, in order.
        skipped_steps: optimizer updates skipped for a non-finite grad norm, over the whole run (resumes
            included).
    """

    skipped_steps: int = 0
    train_losses: list[float] = field(default_factory=list)


class SFTTrainer(TrainingJob[SFTResult]):
    """Supervised fine-tuning of a causal LM on prompt/response data, loss on responses only.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.sft.config.load_config`).
        output_dir: where the model (for the embedded default), data, checkpoints and metrics go.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints`` (an error when there is
            none).
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over (without it, a
            new run refuses a directory that holds checkpoints).
        batch_size_setting: the field of the batch size named in errors (a warm start's is its caller's).
        ctrl_c_saves: the first Ctrl-C saves a checkpoint to resume from (a warm start's: stops at once).
    """

    command = "sft"
    result_type = SFTResult
    report_keys = REPORT_KEYS
    curves = CURVES

    def __init__(
        self,
        config: SFTConfig,
        output_dir: str | Path,
        *,
        resume: bool = False,
        overwrite: bool = False,
        batch_size_setting: str = "trainer.batch_size",
        ctrl_c_saves: bool = True,
    ) -> None:
        if config.model.model_type != "language_model":
            raise ConfigError(
                f"drivetrain sft trains a language model; model.model_type={config.model.model_type!r} has no "
                "next-token log-probs to train on. Set model.model_type=language_model (value models are "
                "trained by the critic role)."
            )
        super().__init__(config, output_dir, resume=resume, overwrite=overwrite, ctrl_c_saves=ctrl_c_saves)
        self.loss_fn = sft_loss_fn(config.trainer.loss_agg_mode)
        self.batch_size_setting = batch_size_setting
        self.measures = HeldOutMetrics.load(config.trainer.eval_metrics)

    def _global_batch(self) -> tuple[str, int]:
        return (self.batch_size_setting, self.config.trainer.batch_size)

    def _setup(self) -> Engine:
        # A resume: before any file is read or written.
        check_or_record_start(self.output_dir, self.config.model.path, resume=self.folder.resume)
        self.model_path = resolve_model_path(
            self.config.model.path, self.output_dir, self.config.engine.seed, resume=self.folder.resume
        )
        self.tokenizer, self.train, val = self._load_data(self.model_path)
        self.folder = self.folder.for_data(e.token_ids for e in self.train)
        self.engine = self._build_engine(self.model_path)
        trainer = self.config.trainer
        self.sampler = StepSampler(
            len(self.train), trainer.batch_size, trainer.seed, setting=self.batch_size_setting
        )
        self.evaluator = _Evaluator(
            self.engine, val, self.tokenizer, self.model_path, self.config, self.loss_fn, self.measures
        )
        return self.engine

    # ------------------------------------------------------------------ setup

    def _load_data(self, model_path: str) -> tuple[Any, list[Example], list[Example]]:
        tokenizer, train, val = load_splits(
            model_path,
            self.config.data,
            self.output_dir,
            self.config.trainer.seed,
            resume=self.folder.resume,
            trust_remote_code=self.config.model.trust_remote_code,
            task=data_task(self.config.model.path),
        )
        _check_token_budget(train + val, self.config.engine.micro_batch.max_tokens)
        check_held_out_size(len(val), self.config.engine)
        return tokenizer, train, val

    def _build_engine(self, model_path: str) -> Engine:
        from drivetrain_engine_core.job import create_engine

        engine = create_engine(
            model_config=dataclasses.replace(self.config.model, path=model_path),
            engine_config=self.config.engine,
            optimizer_config=self.config.run_optimizer(),
            checkpoint_config=self.config.checkpoint,
        )
        engine.initialize()
        return engine

    # ------------------------------------------------------------------ loop

    def _step(self, step: int, result: SFTResult) -> dict[str, float]:
        engine = self.engine
        local = self.sampler.local_indices(step, engine.data_parallel_rank, engine.data_parallel_size)
        with engine.train_mode():
            output = engine.train_batch(make_sft_batch([self.train[i] for i in local]), self.loss_fn)
        engine.lr_scheduler_step()
        values = {**step_record(output), "train/skipped_steps": float(engine.skipped_steps)}
        result.train_losses.append(values["train/loss"])
        result.skipped_steps = engine.skipped_steps
        return values

    def _evaluate(self, step: int) -> dict[str, float]:
        return self.evaluator()

    def _curve_fields(self) -> dict[str, str]:
        return {"loss_agg_mode": self.config.trainer.loss_agg_mode}

    def _curve_panels(self) -> tuple[Panel, ...]:
        return () if self.measures is None else (self.measures.panel,)

    def _save_final(self, engine: Engine, target: Path) -> None:
        save_final_model(
            engine, self.model_path, self.tokenizer, target, max_new_tokens=self.config.trainer.max_new_tokens
        )

    def _report_lines(self, result: SFTResult) -> list[str]:
        """The run directory, the headline measure and why, each held-out measure (the headline first)."""
        lead = headline(self.config.data)
        lines = [f"run directory: {result.output_dir}"]
        if result.evaluations:
            lines.append(f"held-out headline: {lead.metric} ({lead.reason})")
        lines += evaluation_lines(result.evaluations, lead.report_keys())
        if result.train_losses:
            lines.append(f"train/loss at the last step: {result.train_losses[-1]:.4f}")
        return lines

    def _summary(self, result: SFTResult) -> dict[str, Any]:
        return {
            "start_step": result.start_step,
            "final_train_loss": result.train_losses[-1] if result.train_losses else None,
            "skipped_steps": result.skipped_steps,
            "evaluations": result.evaluations,
            "headline": headline(self.config.data).summary(result.evaluations),
        }


@dataclass
class _Evaluator:
    """Held-out loss, perplexity and greedy accuracy of the current weights (empty without held-out data)."""

    engine: Engine
    examples: list[Example]
    tokenizer: Any
    model_path: str
    config: SFTConfig
    loss_fn: Any
    measures: HeldOutMetrics | None = None

    def __call__(self) -> dict[str, float]:
        if not self.examples:
            return {}
        loss = held_out_loss(self.engine, self.examples, self.loss_fn)
        values = {"val/loss": loss, **perplexity(loss, self.config.trainer.loss_agg_mode)}
        samples = self.examples[: self.config.trainer.eval_samples]
        if samples:
            # Building the evaluation model draws random initial weights: keep the training RNG untouched so
            # that evaluating never changes what training does (and resumed runs stay exact).
            with torch.random.fork_rng(devices=[]):
                values |= greedy_evaluation(
                    self.engine,
                    samples,
                    self.tokenizer,
                    max_new_tokens=self.config.trainer.max_new_tokens,
                    model_path=self.model_path,
                    progress=self.config.trainer.progress_bar,
                    measures=self.measures,
                )
        return values


def _check_token_budget(examples: list[Example], max_tokens: int | None) -> None:
    """With dynamic batching every sequence must fit one micro-batch's token budget (a hard cap)."""
    if max_tokens is None:
        return
    longest = max(examples, key=lambda e: e.length)
    if longest.length > max_tokens:
        raise DataError(
            f"an example has {longest.length} tokens but engine.micro_batch.max_tokens={max_tokens}; raise "
            "engine.micro_batch.max_tokens to at least data.max_length."
        )
