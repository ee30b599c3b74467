"""The training loop every job shares (``sft``, ``dpo``, ``rm``, ``grpo``): its schedule, not its steps.

A job supplies what one step does and what an evaluation records; the loop owns the rest, the same in every
command: a held-out evaluation before the first step of a new run, the step's metric record and progress bar,
evaluations every ``trainer.eval_every`` steps and checkpoints every ``trainer.save_every`` steps (both at the
last step too), the heartbeat beats that let a collective timeout name the ranks behind, the divergence guard
(:mod:`.divergence`, ``trainer.divergence``) and Ctrl-C (:mod:`.interrupt`: the first stops the run after the
current step with a checkpoint). After each step the ranks agree in one all-reduce whether to stop, so every
rank stops after the same step.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import Engine
from drivetrain_engine_core.job import DivergenceError
from drivetrain_engine_core.kit import distributed

from ..command_sections import LoopConfig
from .divergence import DivergenceGuard, Trip
from .interrupt import RunInterrupted, StopRequests
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
        guard: the divergence guard, which sees every step's record (a resumed run's: replayed up to its step);
            by default a new one of ``trainer.divergence``.
        ctrl_c_saves: the first Ctrl-C stops the run after the current step with a checkpoint; off, every Ctrl-C
            stops it at once (a warm start, which is never resumed).
    """

    command: str
    trainer: LoopConfig
    folder: RunFolder
    writer: MetricsWriter
    guard: DivergenceGuard | None = None
    ctrl_c_saves: bool = True

    def __post_init__(self) -> None:
        self._guard = self.guard if self.guard is not None else DivergenceGuard(self.trainer.divergence)

    def run(
        self, engine: Engine, start_step: int, *, step: StepFn, evaluate: EvaluateFn, postfix: PostfixFn
    ) -> None:
        """Train from ``start_step``, checkpointing ``engine``; collective (every rank runs the same steps).

        Raises:
            RunInterrupted: Ctrl-C stopped the run after a step, whose checkpoint it names.
            DivergenceError: the divergence guard tripped with ``trainer.divergence.action=stop``.
        """
        heartbeat = self.folder.heartbeat()
        stop = StopRequests(self.command)
        try:
            with (
                heartbeat.naming_laggards(),
                stop.handled() if self.ctrl_c_saves else contextlib.nullcontext(),
            ):
                self._steps(engine, start_step, step, evaluate, postfix, heartbeat.beat, stop)
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
        stop: StopRequests,
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
            trip = self._guard.check(done, values)
            self.writer.write(done, {**values, **trip.record()} if trip else values)
            bar.set_postfix(refresh=False, **postfix(values))
            bar.update(1)
            self._warn(trip, bar)
            if self._agree_to_stop(done, trip, stop):
                beat(done, "save")
                self._save_and_stop(engine, done, bar)
            if self._due(done, self.trainer.eval_every):
                beat(done, "eval")
                evaluate(done, bar)
            if self._due(done, self.trainer.save_every):
                beat(done, "save")
                self.folder.save(engine, done, self.writer)
        bar.close()
        self._stop_if_asked_at_the_end(stop)

    def _warn(self, trip: Trip | None, bar: Any) -> None:
        """One console warning (rank 0) at the first step of each episode of the guard's."""
        if (
            trip is not None
            and trip.first
            and distributed.rank() == 0
            and self._guard.config.action == "warn"
        ):
            bar.write(
                f"drivetrain {self.command}: warning: {trip.describe()}. Warned once per episode; "
                "trainer.divergence.action=stop stops such a run.",
                file=sys.stderr,
            )

    def _agree_to_stop(self, done: int, trip: Trip | None, stop: StopRequests) -> bool:
        """Whether Ctrl-C stops the run after step ``done`` (not the last: it ends anyway), as every rank
        agrees (collective).

        Raises:
            DivergenceError: a rank's guard tripped with ``trainer.divergence.action=stop``.
        """
        # NOTE: rank 0's guard decides: it alone holds a resumed run's earlier records (replayed into it).
        diverged = distributed.rank() == 0 and trip is not None and self._guard.config.action == "stop"
        asked = stop.requested and done < self.trainer.total_steps
        any_diverged, any_asked = distributed.all_reduce_maxes([float(diverged), float(asked)])
        if any_diverged:
            raise DivergenceError(self._divergence_message(trip, done))
        return bool(any_asked)

    def _divergence_message(self, trip: Trip | None, done: int) -> str:
        """What tripped the guard and the last checkpoint saved before it.

        NOTE: step ``t``'s loss and grad norm are measured on the weights after step ``t - 1``, so those weights
        are already suspect: the last good checkpoint is the newest of a step ``<= t - 2``.
        """
        what = trip.describe() if trip is not None else f"step {done}: the divergence guard tripped on rank 0"
        start = self._guard.episodes[-1].since if self._guard.episodes else done
        saved = self.folder.checkpoint_at_most(start - 2)
        where = (
            f"the last checkpoint before the divergence: {saved}"
            if saved is not None
            else f"no checkpoint of a step before {start - 1} (whose weights gave the first value out of line) is left"
        )
        return f"{what}. Stopped (trainer.divergence.action=stop); {where}."

    def _save_and_stop(self, engine: Engine, done: int, bar: Any) -> None:
        """Checkpoint step ``done`` and stop the run (Ctrl-C), skipping the step's evaluation."""
        self.folder.save(engine, done, self.writer)
        bar.close()
        raise self._interrupted(done)

    def _stop_if_asked_at_the_end(self, stop: StopRequests) -> None:
        """A Ctrl-C during the last step, its evaluation or its save stops the run too, as every rank agrees
        (collective): the last step is saved, the final model is not written.

        NOTE: the step boundary's agreement skips the last step (the run ends anyway), so such a Ctrl-C was
        announced as "stops after the current step and saves" and then the run finished with status 0: an
        interrupt reported as success.
        """
        if distributed.all_reduce_max(float(stop.requested)):
            raise self._interrupted(self.trainer.total_steps)

    def _interrupted(self, done: int) -> RunInterrupted:
        """The interrupt of a run stopped after step ``done``, which is saved."""
        checkpoint = self.folder.step_path(done)
        return RunInterrupted(
            f"interrupted after step {done} of {self.trainer.total_steps}; saved checkpoint {checkpoint}. "
            f"Continue with: drivetrain {self.command} --resume --output-dir {self.folder.path}",
            step=done,
            checkpoint=checkpoint,
        )

    def _due(self, done: int, every: int) -> bool:
        """Whether an every-``every``-steps action falls after ``done`` steps (0: only after the last)."""
        return done == self.trainer.total_steps or bool(every and done % every == 0)


__all__ = ["EvaluateFn", "PostfixFn", "StepFn", "StepLoop"]
