"""The template every training job (``sft``, ``dpo``, ``rm``, ``grpo``, a third party's) subclasses.

:meth:`TrainingJob.run` owns the sequence every job shares, in one place: begin the run (process group, batch
check, run folder), the job's setup, resume (a resumed run's ``config.yaml`` once its checkpoint fits), the
metrics writer, the step loop (:class:`~.step_loop.StepLoop`: evaluations, checkpoints, heartbeat, the
divergence guard, Ctrl-C), the final model, the curve and ``summary.json``. A subclass says what is
its own through ``_``-prefixed hooks: what it builds before the first step (:meth:`TrainingJob._setup`, which
returns the engine the checkpoints save), what one step does, what an evaluation measures, how the final
model is written and what its summary holds. :func:`~.command.job_command` turns a subclass into its
``drivetrain <name>`` command.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import write_durably
from drivetrain_engine_core.kit import distributed

from ..runtime.command_config import to_plain
from ..runtime.tracking.jsonl import dumps
from .curves import CURVE_FILE, LOSS_CURVES, Curves, Panel
from .divergence import DivergenceGuard
from .final_model import FINAL_MODEL_DIR
from .launch import SUMMARY_FILE
from .metrics import MetricsWriter, format_record, speed_postfix
from .run_folder import RunFolder, begin_run
from .step_loop import StepLoop


@dataclass
class JobResult:
    """What a run did, on every rank (a job's result adds its own fields).

    Attributes:
        output_dir: the run directory.
        start_step: the step the run started from (0, or the resumed checkpoint's step).
        evaluations: ``{"step", "val/...": value}`` of each evaluation of the run (a resumed run's earlier
            ones from ``metrics.jsonl``).
    """

    output_dir: Path
    start_step: int = 0
    evaluations: list[dict[str, float]] = field(default_factory=list)


ResultT = TypeVar("ResultT", bound=JobResult)


class TrainingJob(ABC, Generic[ResultT]):
    """One training run over any installed engine backend, run the same way on every rank.

    The config needs the sections ``engine`` (an ``EngineConfig``) and ``trainer`` (a ``LoopConfig``: steps,
    evaluation and save intervals, seed, trackers); the rest is the subclass's.

    Args:
        config: the command's config.
        output_dir: the run directory.
        resume: continue from the latest checkpoint in ``<output_dir>/checkpoints`` (an error when there is none).
        overwrite: delete the checkpoints, final model and summary a previous run left in ``output_dir`` and
            start over (without it, a new run refuses a directory that holds checkpoints).
        ctrl_c_saves: the first Ctrl-C during the steps saves a checkpoint to resume from (off for a run that is
            never resumed on its own, such as a warm start: every Ctrl-C stops it at once).
    """

    command: ClassVar[str]
    """The command's name: the progress bar's label, ``outputs/<command>-*``."""

    result_type: ClassVar[type[JobResult]] = JobResult
    """The result :meth:`run` returns (built by :meth:`_new_result`)."""

    report_keys: ClassVar[tuple[str, ...]] = ("val/loss",)
    """The held-out measures :meth:`report` prints, from the first to the last evaluation."""

    curve_file: ClassVar[str] = CURVE_FILE
    """The curve :meth:`_plot` draws in the run folder."""

    curves: ClassVar[Curves] = LOSS_CURVES
    """What the curve shows: the command's headline metrics, each under the name of what it measures."""

    def __init__(
        self,
        config: Any,
        output_dir: str | Path,
        *,
        resume: bool = False,
        overwrite: bool = False,
        ctrl_c_saves: bool = True,
    ) -> None:
        self.config = config
        self.ctrl_c_saves = ctrl_c_saves
        self.output_dir = Path(output_dir)
        self.folder = RunFolder(
            path=self.output_dir, resume=resume, overwrite=overwrite, data_order=self._data_order()
        )
        self.started = 0.0
        self.guard = DivergenceGuard(config.trainer.divergence)

    def run(self) -> ResultT:
        """Set up, train for ``trainer.total_steps`` steps, write the final model and the summary (collective);
        returns this process's result."""
        self.started = time.perf_counter()
        trainer = self.config.trainer
        begin_run(
            self.folder, self.config, engine=self.config.engine, trainer=trainer, batch=self._global_batch()
        )
        engine = self._setup()
        start_step = self._start_step(engine)
        if self.folder.resume:
            self.folder.write_config(self.config)  # the checkpoint fits: see RunFolder.write_config
        writer = MetricsWriter(
            self.output_dir,
            enabled=distributed.rank() == 0,
            report_to=trainer.report_to,
            config=to_plain(self.config),
            resume_step=start_step if self.folder.resume else None,
        )
        result = self._new_result(start_step, writer.earlier_evaluations())
        # A resumed run's steps so far (rank 0 holds them, and its guard decides).
        self.guard.replay(writer.records)
        loop_started = time.perf_counter()
        StepLoop(
            self.command, trainer, self.folder, writer, guard=self.guard, ctrl_c_saves=self.ctrl_c_saves
        ).run(
            engine,
            start_step,
            step=lambda step: self._step(step, result),
            evaluate=lambda step, bar: self._record_eval(step, writer, result, bar),
            postfix=self._postfix,
        )
        loop_seconds = time.perf_counter() - loop_started
        self._save_final(engine, self.output_dir / FINAL_MODEL_DIR)
        self._finish(result, loop_seconds)
        if distributed.rank() == 0:
            self._plot(writer.records)
            self._write_summary(result)
        return result

    def report(self, result: ResultT) -> str:
        """The lines the command prints at the end of a run (rank 0): where the results are."""
        return "\n".join(
            [
                *self._report_lines(result),
                *self._guard_lines(),
                f"trained model: {result.output_dir}/{FINAL_MODEL_DIR} (plain Hugging Face folder, with tokenizer)",
                f"metrics: {result.output_dir}/metrics.jsonl, curve: {result.output_dir}/{self.curve_file}",
            ]
        )

    def _write_summary(self, result: ResultT) -> None:
        """``summary.json``, written last (a run folder with it holds a finished run): :meth:`_summary`'s
        values, the final model's path and the config."""
        summary = {
            **self._summary(result),
            "divergence_guard": self.guard.summary(),
            "final_model": str(self.output_dir / FINAL_MODEL_DIR),
            "config": to_plain(self.config),
        }
        # Whole or not at all: a warm start's reuse reads it.
        write_durably(self.output_dir / SUMMARY_FILE, dumps(summary, indent=2))

    def _guard_lines(self) -> list[str]:
        """A warning line for each episode of the divergence guard's (none when it never tripped)."""
        return [f"warning: {trip.describe()}" for trip in self.guard.episodes]

    def _record_eval(self, step: int, writer: MetricsWriter, result: ResultT, bar: Any) -> None:
        values = self._evaluate(step)
        if not values:
            return
        writer.write(step, values)
        result.evaluations.append({"step": step, **values})
        if distributed.rank() == 0:
            bar.write(f"[{self._eval_label(step)}] {format_record(values)}")

    # ------------------------------------------------------------------ hooks every job has

    @abstractmethod
    def _setup(self) -> Engine:
        """Everything before the first step (collective): the model, the data (tell the run folder with
        ``self.folder = self.folder.for_data(...)``), the engines; returns the engine the checkpoints save."""

    @abstractmethod
    def _step(self, step: int, result: ResultT) -> dict[str, float]:
        """Run step ``step`` (0-based, collective); returns its metric record (and notes it in ``result``)."""

    @abstractmethod
    def _evaluate(self, step: int) -> dict[str, float]:
        """A held-out evaluation after ``step`` steps (collective); empty when there is nothing to evaluate."""

    @abstractmethod
    def _save_final(self, engine: Engine, target: Path) -> None:
        """Write the trained model to ``target`` (collective)."""

    @abstractmethod
    def _summary(self, result: ResultT) -> dict[str, Any]:
        """``summary.json``'s values (rank 0); the final model's path and the config are added after them."""

    # ------------------------------------------------------------------ hooks with a default

    def _data_order(self) -> Mapping[str, int]:
        """The config values the batches of a step depend on (a resumed run must keep them)."""
        return {
            "trainer.seed": self.config.trainer.seed,
            "trainer.batch_size": self.config.trainer.batch_size,
        }

    def _global_batch(self) -> tuple[str, int]:
        """The global batch the data-parallel ranks split, as ``(setting, size)``: checked before any work."""
        return ("trainer.batch_size", self.config.trainer.batch_size)

    def _start_step(self, engine: Engine) -> int:
        """0, or the resumed checkpoint's step, loaded into ``engine`` (collective)."""
        return self.folder.start_step(engine)

    def _new_result(self, start_step: int, evaluations: list[dict[str, float]]) -> ResultT:
        result = self.result_type(output_dir=self.output_dir, start_step=start_step, evaluations=evaluations)
        return result  # type: ignore[return-value]

    def _postfix(self, values: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows of a step's record: by default the loss and speed of a record made by
        :func:`~.metrics.step_record` (``train/loss``, ``perf/step_time_s``, ``perf/tokens_per_s``)."""
        return speed_postfix(values)

    def _eval_label(self, step: int) -> str:
        """The label of an evaluation's line on the console."""
        return f"step {step}"

    def _report_lines(self, result: ResultT) -> list[str]:
        """The run's lines of :meth:`report`, before the final model's and the metrics' paths: by default the
        run directory and each of ``report_keys`` from the first to the last evaluation."""
        return [
            f"run directory: {result.output_dir}",
            *evaluation_lines(result.evaluations, self.report_keys),
        ]

    def _finish(self, result: ResultT, loop_seconds: float) -> None:
        """Complete ``result`` once the final model is written (every rank); ``loop_seconds``: the step loop's
        wall time. Nothing by default."""

    def _curve_fields(self) -> dict[str, str]:
        """The values the labels of :attr:`curves` name (``{loss_type}``): none by default."""
        return {}

    def _curve_panels(self) -> tuple[Panel, ...]:
        """Panels the run adds below :attr:`curves` (a user's own measures): none by default."""
        return ()

    def _plot(self, records: list[dict[str, Any]]) -> None:
        """Draw the run's curve (rank 0), as :attr:`curves` declares it and :meth:`_curve_panels` adds."""
        path = self.output_dir / self.curve_file
        self.curves.plot(records, path, fields=self._curve_fields(), extra=self._curve_panels())


def evaluation_lines(evaluations: list[dict[str, float]], keys: tuple[str, ...]) -> list[str]:
    """``key: first (step s) -> last (step t)`` for each of ``keys`` the evaluations hold."""
    if not evaluations:
        return []
    first, last = evaluations[0], evaluations[-1]
    return [
        f"{key}: {first[key]:.4f} (step {first['step']}) -> {last[key]:.4f} (step {last['step']})"
        for key in keys
        if key in first
    ]


__all__ = ["JobResult", "ResultT", "TrainingJob", "evaluation_lines"]
