"""Generation ahead of training: a rollout thread that fills a bounded queue of batches keyed by step.

The batch of step ``j`` (its prompts and sampling seed are fixed by ``j``) is generated once the rollout serves
weight version ``>= j - lag``, so the trainer, updating step ``k`` from version ``k``, trains on responses at
most ``lag`` versions old while the rollout generates the next ones. The rollout is one object shared with the
trainer's thread: a lock makes the weight hand-off wait for the batch in flight (``hf`` finishes it, then takes
the new version) and keeps evaluation's greedy answers off a batch being generated.

Only the rollout's own ``generate`` runs on the thread (no collective: the rewards, advantages and the
hand-off run on the trainer's thread, in the same order on every rank). Without a lag (``sync``) no thread
starts and :meth:`RolloutPipeline.take` generates in place. A failure on the thread is raised by the next
``take`` with the step and version it was generating.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from drivetrain_engine_core.backend import DrivetrainError
from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig

T = TypeVar("T")
Request = Callable[[int], tuple[Sequence[Sequence[int]], SamplingConfig]]
"""``request(step) -> (prompts, sampling)``: what the batch of ``step`` generates (pure: called on the thread)."""


class RolloutThreadError(DrivetrainError):
    """The rollout thread failed generating a batch."""


@dataclass(frozen=True)
class GeneratedBatch:
    """One step's responses as the rollout produced them.

    Attributes:
        step: the step that trains on them (their prompts and seed are this step's).
        output: the responses and their log-probs.
        version: the weight version the rollout served while generating them.
        started: ``time.perf_counter()`` when generation began.
        finished: when it ended.
    """

    step: int
    output: RolloutOutput
    version: int
    started: float
    finished: float

    @property
    def seconds(self) -> float:
        return self.finished - self.started

    def metrics(self, group: Any = None) -> dict[str, float]:
        """The sampler's own metrics of the batch over ``group`` (collective where they reduce; none here)."""
        return {}


class RolloutPipeline:
    """Batches for steps ``first .. last - 1`` from ``rollout``, generated ``lag`` versions ahead on a thread.

    Args:
        rollout: the rollout, serving ``version``.
        request: the prompts and sampling of a step.
        version: the weight version the rollout serves now.
        first: the first step to generate for (the resumed step, or 0).
        last: one past the last step.
        lag: how many versions ahead of the trainer the rollout may generate; ``None``: no thread,
            :meth:`take` generates in place (``trainer.mode=sync``).
    """

    def __init__(
        self, rollout: Rollout, request: Request, *, version: int, first: int, last: int, lag: int | None
    ) -> None:
        self.rollout = rollout
        self.request = request
        self.lag = lag
        self._lead = lag or 0
        self._version = version
        self._next, self._last = first, last
        self._ready: dict[int, GeneratedBatch] = {}
        self._finished: list[tuple[float, float]] = []
        self._error: BaseException | None = None
        self._closed = False
        self._state = threading.Condition()
        self._rollout_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if lag is not None:
            self._thread = threading.Thread(target=self._produce, name="drivetrain-rollout", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ trainer side

    def take(self, step: int) -> GeneratedBatch:
        """The batch of ``step`` (steps are taken in order), waiting for the thread when it is behind.

        Raises:
            RolloutThreadError: the thread failed (the original exception is the cause).
        """
        if self._thread is None:
            return self._generate(step)
        with self._state:
            self._state.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:
                raise RolloutThreadError(str(self._error)) from self._error
            return self._ready.pop(step)

    def update(self, hand_off: Callable[[], T], version: int) -> T:
        """Run ``hand_off`` (which makes the rollout serve ``version``) once the batch in flight is finished;
        the thread may then generate the batches that ``version`` allows."""
        with self._rollout_lock:
            result = hand_off()
            # NOTE: set before the lock is released: a batch started right after must not be labelled with the
            # version it no longer generates with.
            with self._state:
                self._version = version
                self._state.notify_all()
        return result

    @contextmanager
    def exclusive(self) -> Iterator[Rollout]:
        """The rollout, with no batch being generated meanwhile (evaluation's answers)."""
        with self._rollout_lock:
            yield self.rollout

    def overlap(self, start: float, end: float) -> float:
        """Seconds of generation that ran within ``[start, end]`` (the trainer's update), over the batches
        finished so far (the hand-off waits for the one in flight, so after it every overlapping one is)."""
        with self._state:
            spans, self._finished = self._finished, [s for s in self._finished if s[1] > end]
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)

    def close(self) -> None:
        """Stop the thread after the batch in flight (batches generated but not taken are discarded: a resumed
        run generates them again from its checkpoint's step)."""
        with self._state:
            self._closed = True
            self._state.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ rollout thread

    def _produce(self) -> None:
        try:
            while True:
                with self._state:
                    self._state.wait_for(self._may_generate)
                    if self._closed or self._next >= self._last:
                        return
                    step = self._next
                    self._next += 1
                batch = self._generate(step)
                with self._state:
                    self._ready[step] = batch
                    self._finished.append((batch.started, batch.finished))
                    self._state.notify_all()
        except BaseException as e:  # raised again by take() on the trainer's thread
            with self._state:
                self._error = RolloutThreadError(
                    f"the rollout thread failed generating the batch of step {self._next - 1} with weight version "
                    f"{self._version}: {type(e).__name__}: {e}"
                )
                self._error.__cause__ = e
                self._state.notify_all()

    def _may_generate(self) -> bool:
        """Stopping, done, or the next step's batch is within ``lag`` versions and the queue has room."""
        if self._closed or self._next >= self._last:
            return True
        return self._next - self._version <= self._lead and len(self._ready) <= self._lead

    def _generate(self, step: int) -> GeneratedBatch:
        prompts, sampling = self.request(step)
        with self._rollout_lock:
            version = self._version
            started = time.perf_counter()
            output = self.rollout.generate(prompts, sampling)
            finished = time.perf_counter()
        return GeneratedBatch(step=step, output=output, version=version, started=started, finished=finished)
