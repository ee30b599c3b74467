"""The loop shared by ``drivetrain dpo`` and ``drivetrain rm``: run folder, warm start, pairs, steps, evaluation.

One process per rank. The run folder holds ``config.yaml``, ``data/`` (generated pairs), ``warm_start/`` (the
SFT run the pairwise training starts from), ``checkpoints/``, ``metrics.jsonl``, ``loss_curve.png``,
``summary.json`` and ``final_model/``. Per step: this rank's share of the step's pairs (both sides of a pair
on one rank and in one micro-batch) -> ``engine.train_batch`` with the pairwise loss -> one LR-schedule step.
``resume=True`` continues from the latest checkpoint with the finished warm start, the same starting model
(and so the same reference) and the same data order, so a resumed run reproduces the uninterrupted one exactly.
Subclasses (template method) give the model type, the loss, the batches, extra evaluation and the export.
"""

from __future__ import annotations

import dataclasses
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from drivetrain_engine_core.backend import Engine, EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import CheckpointConfig, ForwardBackwardOutput, LossFn
from drivetrain_engine_core.kit import distributed
from tensordict import TensorDict

from ..jobs.assets import load_tokenizer, resolve_model_path
from ..jobs.batches import StepSampler, check_held_out_size
from ..jobs.job import JobResult, TrainingJob, evaluation_lines
from ..jobs.metrics import step_record
from ..jobs.resume_start import check_or_record_start
from ..sft.warm_start import run_warm_start
from .batches import check_pair_micro_batches, check_pair_token_budget
from .config import PairDataConfig, PairTrainerConfig, WarmStartConfig
from .data import PairExample, check_pair_rows, load_pairs, write_sft_rows
from .default_pairs import write_arithmetic_pairs
from .warm_start import warm_start_config


@dataclass
class PairResult(JobResult):
    """What a run did, on every rank (see :class:`~drivetrain_roles.jobs.job.JobResult`).

    Attributes:
        start_model: the model the pairwise training started from (the warm start's final model, or
            ``model.path``).
        warm_start: the warm start's last evaluation (``val/loss``, ``val/accuracy``), if it ran.
        train_losses: the loss of each step this process ran.
        seconds: wall time of the whole run (warm start included).
    """

    start_model: str = ""
    warm_start: dict[str, float] = field(default_factory=dict)
    train_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


class PairTrainer(TrainingJob[PairResult]):
    """Training on preference pairs over any installed engine backend.

    Args:
        config: the command's config; it has the sections ``model``, ``engine``, ``optimizer``, ``checkpoint``,
            ``data`` (:class:`PairDataConfig`), ``warm_start`` and ``trainer`` (:class:`PairTrainerConfig`).
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints`` (an error when there is
            none), with the warm start that run finished.
        overwrite: delete the checkpoints a previous run left in ``output_dir`` (else such a directory is
            refused).
    """

    model_type: ClassVar[str]
    """The engine's model type: ``language_model`` (DPO) or ``value_model`` (reward model)."""

    result_type = PairResult

    def __init__(
        self, config: Any, output_dir: str | Path, *, resume: bool = False, overwrite: bool = False
    ) -> None:
        super().__init__(config, output_dir, resume=resume, overwrite=overwrite)
        self.uids: dict[int, PairExample] = {}

    # ------------------------------------------------------------------ sections, typed
    @property
    def data(self) -> PairDataConfig:
        return self.config.data

    @property
    def trainer(self) -> PairTrainerConfig:
        return self.config.trainer

    @property
    def engine_config(self) -> EngineConfig:
        return self.config.engine

    def _setup(self) -> Engine:
        """Pair files, warm start, pairs, the engine and the job's preparation (DPO: the reference)."""
        # A resume: before any file is read or written.
        warm_start = ("warm_start.sft_steps", self.config.warm_start.sft_steps)
        check_or_record_start(
            self.output_dir, self.config.model.path, resume=self.folder.resume, warm_start=warm_start
        )
        train_files, val_files = self._pair_files()
        # Before the warm start: pair data the pairwise steps could not use fails fast, on every rank.
        check_pair_micro_batches(self.engine_config.micro_batch)
        check_pair_rows(train_files, self.data)
        check_held_out_size(check_pair_rows(val_files, self.data, held_out=True), self.config.engine, "pairs")
        self.start_model, self.warm_start = self._warm_start(train_files, val_files)
        tokenizer = load_tokenizer(self.start_model, trust_remote_code=self.config.model.trust_remote_code)
        train = load_pairs(train_files, tokenizer, self.data)
        self.folder = self.folder.for_data(
            side.token_ids for pair in train for side in (pair.chosen, pair.rejected)
        )
        val = load_pairs(val_files, tokenizer, self.data, held_out=True) if val_files else []
        check_held_out_size(len(val), self.config.engine, "pairs")  # again: data.overlong=drop may skip some
        check_pair_token_budget(train + val, self.engine_config.micro_batch)
        self.uids = dict(enumerate(train + val))
        self.tokenizer = tokenizer
        self.model_path = self._start_model(self.start_model)
        self.engine = self._build_engine(self.model_path, self.config.run_optimizer(), self.config.checkpoint)
        # Before the resume (the template's next step): a reference taken from the actor must be the starting
        # model, not the checkpoint.
        self._prepare(self.engine, self.model_path, tokenizer)
        self.sampler = StepSampler(len(train), self.trainer.batch_size, self.trainer.seed)
        self.val_uids = list(range(len(train), len(train) + len(val)))
        return self.engine

    def _new_result(self, start_step: int, evaluations: list[dict[str, float]]) -> PairResult:
        result = super()._new_result(start_step, evaluations)
        result.start_model, result.warm_start = self.start_model, self.warm_start
        return result

    # ------------------------------------------------------------------ setup

    def _pair_files(self) -> tuple[list[str], list[str]]:
        """The configured pair files, or the generated arithmetic pairs under ``<run>/data``."""
        if not self.data.generated:
            return list(self.data.train_files), list(self.data.val_files)
        directory = self.output_dir / "data"
        train, val = directory / "train.jsonl", directory / "val.jsonl"
        # NOTE: written by every new run; a resumed run keeps the pairs it started from.
        if distributed.rank() == 0 and not (self.folder.resume and train.is_file() and val.is_file()):
            write_arithmetic_pairs(
                directory,
                train_size=self.data.generated_train_size,
                val_size=self.data.generated_val_size,
                seed=self.trainer.seed,
                rejected_per_prompt=self.data.generated_rejected_per_prompt,
            )
        distributed.barrier()
        return [str(train)], [str(val)] if self.data.generated_val_size else []

    def _warm_start(self, train_files: list[str], val_files: list[str]) -> tuple[str, dict[str, float]]:
        """The model the pairwise training starts from (the SFT warm start's final model, or ``model.path``)
        and the warm start's last evaluation (empty without a warm start)."""
        warm: WarmStartConfig = self.config.warm_start
        model: ModelConfig = self.config.model
        if warm.sft_steps == 0:
            path = resolve_model_path(
                model.path, self.output_dir, self.engine_config.seed, resume=self.folder.resume
            )
            return path, {}
        directory = self.output_dir / "data"
        sft_train = [str(directory / f"sft_train_{i}.jsonl") for i in range(len(train_files))]
        sft_val = [str(directory / f"sft_val_{i}.jsonl") for i in range(len(val_files))]
        sft_config = warm_start_config(
            model=model,
            engine=self.engine_config,
            warm_start=warm,
            data=self.data,
            trainer=self.trainer,
            sft_files=(sft_train, sft_val),
        )
        return run_warm_start(
            sft_config,
            self.output_dir,
            reuse=self.folder.resume,
            batch_size_setting="warm_start.batch_size",
            write_data=lambda: self._write_sft_rows(
                [*((f, False) for f in train_files), *((f, True) for f in val_files)], sft_train + sft_val
            ),
        )

    def _write_sft_rows(self, pair_files: list[tuple[str, bool]], sft_files: list[str]) -> None:
        """Each pair source's prompts and chosen responses (``(source, held out)``) as the warm start's SFT rows
        (rank 0; collective)."""
        if distributed.rank() == 0:
            for (source, held_out), target in zip(pair_files, sft_files, strict=True):
                write_sft_rows(source, Path(target), self.data, held_out=held_out)
        distributed.barrier()

    def _build_engine(
        self, model_path: str, optimizer: OptimizerConfig | None, checkpoint: CheckpointConfig | None = None
    ) -> Engine:
        from drivetrain_engine_core.job import create_engine

        engine = create_engine(
            model_config=dataclasses.replace(self.config.model, path=model_path, model_type=self.model_type),
            engine_config=self.engine_config,
            optimizer_config=optimizer,
            checkpoint_config=checkpoint,
        )
        engine.initialize()
        return engine

    # ------------------------------------------------------------------ loop

    def _step(self, step: int, result: PairResult) -> dict[str, float]:
        engine = self.engine
        local = self.sampler.local_indices(step, engine.data_parallel_rank, engine.data_parallel_size)
        batch = self._batch(engine, local)
        with engine.train_mode():
            output = engine.train_batch(batch, self._loss_fn())
        engine.lr_scheduler_step()
        values = {
            **step_record(output),
            **{f"train/{k}": v for k, v in global_metrics(engine, output).items()},
        }
        result.train_losses.append(values["train/loss"])
        return values

    def _evaluate(self, step: int) -> dict[str, float]:
        if not self.val_uids:
            return {}
        engine = self.engine
        rank, size = engine.data_parallel_rank, engine.data_parallel_size
        batch = self._batch(engine, self.val_uids[rank::size])
        with engine.eval_mode():
            output = engine.infer_batch(batch, self._loss_fn())
        values = {"val/loss": float(output.loss)}  # type: ignore[arg-type]
        values.update({f"val/{k}": v for k, v in global_metrics(engine, output).items()})
        pairs = [self.uids[u] for u in self.val_uids]
        # Building a Hugging Face model draws random weights: keep the training RNG untouched.
        with torch.random.fork_rng(devices=[]):
            values.update(self._extra_eval(engine, self.tokenizer, self.model_path, pairs))
        return values

    def _eval_label(self, step: int) -> str:
        return f"{self.command} step {step}"

    def _save_final(self, engine: Engine, target: Path) -> None:
        self._export(engine, self.model_path, self.tokenizer, target)

    def _finish(self, result: PairResult, loop_seconds: float) -> None:
        result.seconds = time.perf_counter() - self.started

    def _summary(self, result: PairResult) -> dict[str, Any]:
        return {
            "start_step": result.start_step,
            "start_model": result.start_model,
            "warm_start": result.warm_start,
            "final_train_loss": result.train_losses[-1] if result.train_losses else None,
            "evaluations": result.evaluations,
            "seconds": result.seconds,
        }

    def _report_lines(self, result: PairResult) -> list[str]:
        lines = [f"run directory: {result.output_dir} ({result.seconds:.0f} s)"]
        if result.warm_start:
            lines.append(
                "warm start (SFT): " + ", ".join(f"{k}={v:.4f}" for k, v in result.warm_start.items())
            )
        return [*lines, *evaluation_lines(result.evaluations, self.report_keys)]

    # ------------------------------------------------------------------ hooks

    def _start_model(self, start_model: str) -> str:
        """The directory the engine loads (default: the start model itself)."""
        return start_model

    def _prepare(self, engine: Engine, model_path: str, tokenizer: Any) -> None:
        """Work before the first step (DPO: the reference); nothing by default."""

    @abstractmethod
    def _loss_fn(self) -> LossFn:
        """The pairwise loss."""

    @abstractmethod
    def _batch(self, engine: Engine, uids: list[int]) -> TensorDict:
        """This rank's batch of the pairs ``uids`` (collective when it needs the engine)."""

    @abstractmethod
    def _extra_eval(
        self, engine: Engine, tokenizer: Any, model_path: str, pairs: list[PairExample]
    ) -> dict[str, float]:
        """More held-out measures (collective); the held-out loss and loss metrics are measured already."""

    @abstractmethod
    def _export(self, engine: Engine, model_path: str, tokenizer: Any, target: Path) -> None:
        """Write the trained model as a plain Hugging Face folder (collective)."""


def global_metrics(engine: Engine, output: ForwardBackwardOutput) -> dict[str, float]:
    """The loss function's metrics over the whole mini-batch: contributions summed over micro-batches and ranks."""
    names = sorted(k for k, v in output.metrics.items() if isinstance(v, list))
    local = [sum(output.metrics[name]) for name in names]  # type: ignore[arg-type]
    totals = distributed.all_reduce_sums(local, engine.data_parallel_group) if names else []
    return {name: float(total) for name, total in zip(names, totals, strict=True)}
