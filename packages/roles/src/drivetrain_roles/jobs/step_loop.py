"""The training loop every job shares (``sft``, ``dpo``, ``rm``, ``grpo``): its schedule, not its steps.

A job supplies what one step does and what an evaluation records; the loop owns the rest, the same in every
command: a held-out evaluation before the first step of a new run, the step's metric record and progress bar,
evaluations every ``trainer.eval_every`` steps and checkpoints every ``trainer.save_every`` steps (both at the
last step too), and the heartbeat beats that let a collective timeout name the ranks behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.engine import Engine

from ..command_sections import LoopConfig
from .metrics import MetricsWriter
from .progress import progress_bar
from .run_folder import RunFolder

StepFn = Callable[[int], dict[str, float]]
"""Runs step ``step`` (0-based) and returns its metric record."""
EvaluateFn = Callable[[int, Any], None]
"""Records a held-out evaluation after ``step`` steps; gets the progress bar to print on."""
PostfixFn = Callable[[dict[str, float]], dict[str, str]]
"""What the progress bar shows of a step's record."""


@dataclass
class StepLoop:
    """The loop of one run, from ``start_step`` to ``trainer.total_steps``.

    Attributes:
        command: the command's name (the progress bar's label).
        trainer: the command's ``trainer`` section (steps, evaluation and save intervals, progress bar).
        folder: the run folder (checkpoints, heartbeat).
        writer: where step records go; closed when the loop ends, however it ends.
    """

    command: str
    trainer: LoopConfig
    folder: RunFolder
    writer: MetricsWriter

    def run(
        self, engine: Engine, start_step: int, *, step: StepFn, evaluate: EvaluateFn, postfix: PostfixFn
    ) -> None:
        """Train from ``start_step``, checkpointing ``engine``; collective (every rank runs the same steps)."""
        heartbeat = self.folder.heartbeat()
        try:
            with heartbeat.naming_laggards():
                self._steps(engine, start_step, step, evaluate, postfix, heartbeat.beat)
        finally:
            self.writer.close()

    def _steps(
        self,
        engine: Engine,
        start_step: int,
        step: StepFn,
        evaluate: EvaluateFn,
        postfix: PostfixFn,
        beat: Callable[[int, str], None],
    ) -> None:
        total = self.trainer.total_steps
        bar = progress_bar(self.command, total, start_step, enabled=self.trainer.progress_bar)
        if start_step == 0:
            beat(0, "eval")
            evaluate(0, bar)
        for index in range(start_step, total):
            done = index + 1
            beat(done, "train")
            values = step(index)
            self.writer.write(done, values)
            bar.set_postfix(refresh=False, **postfix(values))
            bar.update(1)
            if self._due(done, self.trainer.eval_every):
                beat(done, "eval")
                evaluate(done, bar)
            if self._due(done, self.trainer.save_every):
                beat(done, "save")
                self.folder.save(engine, done, self.writer)
        bar.close()

    def _due(self, done: int, every: int) -> bool:
        """Whether an every-``every``-steps action falls after ``done`` steps (0: only after the last)."""
        return done == self.trainer.total_steps or bool(every and done % every == 0)


__all__ = ["EvaluateFn", "PostfixFn", "StepFn", "StepLoop"]
