"""The SFT training loop over any installed engine backend.

One process per rank (``torchrun`` or ``drivetrain sft --nproc N``); every rank runs this loop, the engine
shards the work, and the output rank writes metrics. Per step: this rank's share of the global batch ->
``engine.train_batch`` with the SFT loss -> one LR-schedule step. Held-out loss and greedy accuracy are
measured before the first step, every ``trainer.eval_every`` steps and after the last; checkpoints go to
``<output_dir>/checkpoints`` every ``trainer.save_every`` steps and at the end, and ``resume=True`` continues
from the latest one with the same data order, so a resumed run reproduces the uninterrupted one exactly.
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
from drivetrain_engine_core import distributed
from drivetrain_engine_core.checkpoint.durable import write_durably
from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.engine import Engine

from ..jobs.assets import load_splits, resolve_model_path
from ..jobs.batches import StepSampler, check_held_out_size, make_sft_batch
from ..jobs.data import DataError, Example
from ..jobs.evaluate import greedy_accuracy, held_out_loss
from ..jobs.final_model import FINAL_MODEL_DIR, save_final_model
from ..jobs.launch import SUMMARY_FILE
from ..jobs.metrics import (
    CURVE_FILE,
    MetricsWriter,
    format_record,
    plot_loss_curve,
    speed_postfix,
    step_record,
)
from ..jobs.run_folder import RunFolder, begin_run
from ..jobs.step_loop import StepLoop
from ..losses.sft import sft_loss_fn
from ..runtime.command_config import to_plain
from ..runtime.tracking.jsonl import dumps
from .config import SFTConfig

logger = logging.getLogger(__name__)


@dataclass
class SFTResult:
    """What a run did, on every rank.

    Attributes:
        output_dir: the run directory.
        start_step: the step the run started from (0, or the resumed checkpoint's step).
        train_losses: the training loss of each step this process ran, in order.
        evaluations: ``{"step", "val/loss", "val/accuracy"}`` of each evaluation of the run (a resumed run's
            earlier ones from ``metrics.jsonl``).
        skipped_steps: optimizer updates skipped for a non-finite grad norm, over the whole run (resumes
            included).
    """

    output_dir: Path
    start_step: int
    skipped_steps: int = 0
    train_losses: list[float] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)


class SFTTrainer:
    """Supervised fine-tuning of a causal LM on prompt/response data, loss on responses only.

    Args:
        config: the run's configuration (see :func:`~drivetrain_roles.sft.config.load_config`).
        output_dir: where the model (for the embedded default), data, checkpoints and metrics go.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints`` (an error when there is
            none).
        overwrite: delete the checkpoints a previous run left in ``output_dir`` and start over (without it, a
            new run refuses a directory that holds checkpoints).
    """

    def __init__(
        self,
        config: SFTConfig,
        output_dir: str | Path,
        *,
        resume: bool = False,
        overwrite: bool = False,
        batch_size_setting: str = "trainer.batch_size",
    ) -> None:
        if config.model.model_type != "language_model":
            raise ConfigError(
                f"drivetrain sft trains a language model; model.model_type={config.model.model_type!r} has no "
                "next-token log-probs to train on. Set model.model_type=language_model (value models are "
                "trained by the critic role)."
            )
        self.config = config
        self.output_dir = Path(output_dir)
        self.folder = RunFolder(
            path=self.output_dir,
            resume=resume,
            overwrite=overwrite,
            data_order={"trainer.seed": config.trainer.seed, "trainer.batch_size": config.trainer.batch_size},
        )
        self.loss_fn = sft_loss_fn(config.trainer.loss_agg_mode)
        self.batch_size_setting = batch_size_setting

    def run(self) -> SFTResult:
        """Train for ``trainer.total_steps`` steps; returns this process's losses and the run's evaluations."""
        begin_run(
            self.folder,
            self.config,
            engine=self.config.engine,
            trainer=self.config.trainer,
            batch=(self.batch_size_setting, self.config.trainer.batch_size),
        )
        model_path = resolve_model_path(
            self.config.model.path, self.output_dir, self.config.engine.seed, resume=self.folder.resume
        )
        tokenizer, train, val = self._load_data(model_path)
        self.folder = self.folder.for_data(e.token_ids for e in train)
        engine = self._build_engine(model_path)
        trainer = self.config.trainer
        sampler = StepSampler(len(train), trainer.batch_size, trainer.seed, setting=self.batch_size_setting)
        start_step = self.folder.start_step(engine)
        writer = MetricsWriter(
            self.output_dir,
            enabled=distributed.rank() == 0,
            report_to=self.config.trainer.report_to,
            config=to_plain(self.config),
            resume_step=start_step if self.folder.resume else None,
        )
        result = SFTResult(
            output_dir=self.output_dir, start_step=start_step, evaluations=writer.earlier_evaluations()
        )
        evaluate = _Evaluator(engine, val, tokenizer, model_path, self.config, self.loss_fn)
        StepLoop("sft", trainer, self.folder, writer).run(
            engine,
            start_step,
            step=lambda step: self._step(engine, sampler, train, step, result),
            evaluate=lambda step, bar: self._record_eval(evaluate, step, writer, result, bar),
            postfix=speed_postfix,
        )
        save_final_model(
            engine,
            model_path,
            tokenizer,
            self.output_dir / FINAL_MODEL_DIR,
            max_new_tokens=self.config.trainer.max_new_tokens,
        )
        if distributed.rank() == 0:
            plot_loss_curve(writer.records, self.output_dir / CURVE_FILE)
            _write_summary(self.output_dir, result, to_plain(self.config))
        return result

    # ------------------------------------------------------------------ setup

    def _load_data(self, model_path: str) -> tuple[Any, list[Example], list[Example]]:
        tokenizer, train, val = load_splits(
            model_path,
            self.config.data,
            self.output_dir,
            self.config.trainer.seed,
            resume=self.folder.resume,
            trust_remote_code=self.config.model.trust_remote_code,
        )
        _check_token_budget(train + val, self.config.engine.micro_batch.max_tokens)
        check_held_out_size(len(val), self.config.engine)
        return tokenizer, train, val

    def _build_engine(self, model_path: str) -> Engine:
        from drivetrain_engine_core.factory import create_engine

        engine = create_engine(
            model_config=dataclasses.replace(self.config.model, path=model_path),
            engine_config=self.config.engine,
            optimizer_config=self.config.run_optimizer(),
            checkpoint_config=self.config.checkpoint,
        )
        engine.initialize()
        return engine

    # ------------------------------------------------------------------ loop

    def _step(
        self, engine: Engine, sampler: StepSampler, train: list[Example], step: int, result: SFTResult
    ) -> dict[str, float]:
        local = sampler.local_indices(step, engine.data_parallel_rank, engine.data_parallel_size)
        with engine.train_mode():
            output = engine.train_batch(make_sft_batch([train[i] for i in local]), self.loss_fn)
        engine.lr_scheduler_step()
        values = {**step_record(output), "train/skipped_steps": float(engine.skipped_steps)}
        result.train_losses.append(values["train/loss"])
        result.skipped_steps = engine.skipped_steps
        return values

    def _record_eval(
        self, evaluate: _Evaluator, step: int, writer: MetricsWriter, result: SFTResult, bar: Any
    ) -> None:
        values = evaluate()
        if not values:
            return
        writer.write(step, values)
        result.evaluations.append({"step": step, **values})
        if distributed.rank() == 0:
            bar.write(f"[step {step}] {format_record(values)}")


@dataclass
class _Evaluator:
    """Held-out loss and greedy accuracy of the current weights (empty when there is no held-out data)."""

    engine: Engine
    examples: list[Example]
    tokenizer: Any
    model_path: str
    config: SFTConfig
    loss_fn: Any

    def __call__(self) -> dict[str, float]:
        if not self.examples:
            return {}
        values = {"val/loss": held_out_loss(self.engine, self.examples, self.loss_fn)}
        samples = self.examples[: self.config.trainer.eval_samples]
        if samples:
            # Building the evaluation model draws random initial weights: keep the training RNG untouched so
            # that evaluating never changes what training does (and resumed runs stay exact).
            with torch.random.fork_rng(devices=[]):
                values["val/accuracy"] = greedy_accuracy(
                    self.engine,
                    samples,
                    self.tokenizer,
                    max_new_tokens=self.config.trainer.max_new_tokens,
                    model_path=self.model_path,
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


def _write_summary(output_dir: Path, result: SFTResult, config: dict[str, Any]) -> None:
    summary = {
        "start_step": result.start_step,
        "final_train_loss": result.train_losses[-1] if result.train_losses else None,
        "skipped_steps": result.skipped_steps,
        "evaluations": result.evaluations,
        "final_model": str(output_dir / FINAL_MODEL_DIR),
        "config": config,
    }
    # Whole or not at all: a warm start's reuse reads it.
    write_durably(output_dir / SUMMARY_FILE, dumps(summary, indent=2))
