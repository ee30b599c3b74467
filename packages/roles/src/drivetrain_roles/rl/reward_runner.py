"""Reward functions run concurrently within a time limit, so that a slow one does not stall the step and a stuck
one does not hang it.

Each function runs on daemon threads of its own: a batch function on one thread, called once with every
completion and, if that raises, again completion by completion (so that the failure names the row, and the other
rows keep their rewards); verl's per-completion ``compute_score`` on up to :data:`PER_COMPLETION_THREADS`
threads. The caller waits until every function has finished or ``algorithm.reward_timeout_s`` has passed since
they started; a completion without a value then has timed out. Without a time limit the functions run one after
another on the calling thread (for functions that need the main thread, e.g. for ``signal.alarm``).

A reward model (:mod:`..reward_model`, a ``collective`` reward) is no thread's work: its forward is a collective
of every rank's engine, so it runs once per batch on the calling thread while the functions run on theirs, and
its error is raised as it is (retrying one rank's rows alone would leave the other ranks waiting).

NOTE: Python cannot stop a thread: a function that runs out of time is abandoned, not killed. Its thread runs on
in the background, a daemon thread, which does not keep the process from exiting; whatever it returns later is
dropped.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch

from .reward_inputs import RewardInputs
from .reward_signatures import LoadedReward, RewardError

PER_COMPLETION_THREADS = 8
"""Threads of one per-completion function (verl's ``compute_score``), each taking the next completion."""

MISSING: Any = object()
"""A completion's value before its function returned it."""


@dataclass
class Outcome:
    """What one function gave for a batch.

    Attributes:
        values: per completion, a number, ``None`` (not applicable) or :data:`MISSING` (raised or timed out).
        errors: completion -> what the function raised on it alone.
        invalid: the function returned something that is not one number or ``None`` per completion (a bug in
            the function, never scored as a failure).
    """

    values: list[Any]
    errors: dict[int, BaseException] = field(default_factory=dict)
    invalid: RewardError | None = None

    @property
    def timed_out(self) -> list[int]:
        """The completions whose function neither returned nor raised in time."""
        return [i for i, v in enumerate(self.values) if v is MISSING and i not in self.errors]


def run_rewards(
    rewards: Sequence[LoadedReward], inputs: RewardInputs, timeout_s: float | None
) -> list[Outcome]:
    """Every function's :class:`Outcome` over ``inputs``, concurrently within ``timeout_s`` (see the module
    docstring); a collective reward (a reward model) on the calling thread meanwhile, once, its error raised."""
    runs = [_Run(reward, inputs) for reward in rewards if not reward.collective]
    threaded = timeout_s is not None
    deadline = time.monotonic() + (timeout_s or 0.0)
    for run in runs if threaded else ():
        run.start()
    collective = {
        id(reward): Outcome(values=checked_values(reward(inputs), len(inputs), reward))
        for reward in rewards
        if reward.collective
    }
    for run in runs:
        if threaded:
            run.join(deadline)
        else:
            run.work()
    outcomes = iter(run.outcome() for run in runs)
    return [collective[id(reward)] if reward.collective else next(outcomes) for reward in rewards]


class _Run:
    """One function's calls over a batch; results land here until the caller takes the outcome."""

    def __init__(self, reward: LoadedReward, inputs: RewardInputs) -> None:
        self.reward, self.inputs = reward, inputs
        self.units: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        rows = list(range(len(inputs)))
        for unit in [[row] for row in rows] if reward.per_completion else [rows]:
            self.units.put(unit)
        threads = min(PER_COMPLETION_THREADS, len(rows)) if reward.per_completion else 1
        self.threads = [
            threading.Thread(target=self.work, name=f"reward {reward.name}", daemon=True)
            for _ in range(threads)
        ]
        self.lock = threading.Lock()
        self.result = Outcome(values=[MISSING] * len(rows))
        self.closed = False

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, deadline: float) -> None:
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def outcome(self) -> Outcome:
        """What arrived so far; later arrivals are dropped."""
        with self.lock:
            self.closed = True
            return Outcome(
                values=list(self.result.values), errors=dict(self.result.errors), invalid=self.result.invalid
            )

    def work(self) -> None:
        """Take units until none is left: call the function; a unit of several rows that raises comes back as
        single rows."""
        while not self.closed:
            try:
                rows = self.units.get_nowait()
            except queue.Empty:
                return
            try:
                returned = self.reward(
                    self.inputs if len(rows) == len(self.inputs) else self.inputs.take(rows)
                )
            except Exception as e:
                if len(rows) > 1:
                    for row in rows:
                        self.units.put([row])
                else:
                    self._keep(errors={rows[0]: e})
                continue
            try:
                self._keep(
                    values=dict(zip(rows, checked_values(returned, len(rows), self.reward), strict=True))
                )
            except RewardError as e:
                self._keep(invalid=e)
                return

    def _keep(
        self,
        values: dict[int, Any] | None = None,
        errors: dict[int, BaseException] | None = None,
        invalid: RewardError | None = None,
    ) -> None:
        with self.lock:
            if self.closed:
                return
            for row, value in (values or {}).items():
                self.result.values[row] = value
            self.result.errors.update(errors or {})
            self.result.invalid = self.result.invalid or invalid


def checked_values(returned: Any, expected: int, reward: LoadedReward) -> list[float | None]:
    """``returned`` as one float or ``None`` per completion.

    Raises:
        RewardError: not ``expected`` values, or a value that is no finite number and not ``None`` (a bool is a
            verdict, not a reward; ``numbers.Real`` takes Python and NumPy numbers alike).
    """
    try:
        values = returned.tolist() if isinstance(returned, torch.Tensor) else list(returned)
    except TypeError:
        values = [returned]
    bad = [
        v
        for v in values
        if v is not None and (isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(v))
    ]
    if len(values) != expected or bad:
        problem = f"{len(values)} values" if len(values) != expected else f"{bad[:3]}"
        raise RewardError(
            f"reward function {reward.spec!r} returned {problem} for {expected} completions; it must return one "
            "finite number (or None: not applicable) per completion (a list, or a 1-D tensor), in their order."
        )
    return [None if v is None else float(v) for v in values]
