"""The divergence guard every job's step loop runs: a loss or grad norm that blows up, a grad norm that
collapses, a learning rate of 0.

A run whose learning rate is far too high (``drivetrain sft optimizer.lr=100``: held-out loss 2.86 ->
2,343,977 in 30 steps) finished with exit status 0 and "trained model: ...", and one at ``optimizer.lr=0``
trained nothing, silently; only non-finite grad norms were caught (core's skipped steps). The guard reads each
step's record and trips when, for ``patience`` steps in a row:

- ``train/loss`` or ``train/grad_norm`` is above ``factor`` times its baseline, or ``train/grad_norm`` below
  its baseline divided by ``factor`` (a policy trained at a learning rate far too high collapses: ``drivetrain
  grpo optimizer.lr=1``'s grad norm fell from 0.33 to 0.004 in one step and to 1e-13 in four, its held-out
  accuracy from 0.23 to 0.005). The baseline is the median of the metric's last ``window`` values that were
  inside those lines, from the run's first step on, so a run that diverges at once is caught before it has a
  history; a median, unlike a mean or an exponential average, is not dragged by a few spikes, and values
  outside the lines never enter it. Several steps in a row, because a single healthy step can spike: the
  embedded jobs' grad norms reach 10x their running median for one step (``rm``); over three steps in a row
  their default runs would trip only a factor under 4.5 (``rm``; the others under 2.8);
- or ``train/lr`` is exactly 0 (no update changes the weights).

A metric a job does not record (GRPO has no ``train/loss``; PPO's actor none during the critic's warm-up) is
not checked; a non-finite value is core's to handle (the step is skipped) and is ignored here. The guard is a
pure function of the records it is shown, so a resumed run replays the records up to its step
(:meth:`DivergenceGuard.replay`) and goes on as the uninterrupted run would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from drivetrain_engine_core.backend import ConfigError

DivergenceAction = Literal["warn", "stop", "off"]
TripKind = Literal["diverged", "collapsed", "stalled"]
WATCHED = ("train/loss", "train/grad_norm")
"""The metrics checked against their baseline (each only where a job records it)."""
COLLAPSING = ("train/grad_norm",)
"""The watched metrics also checked for falling below their baseline by ``factor``."""
_TINY = 1e-300
"""Stands in for a grad norm of exactly 0 when ranking how far out a value is."""
LR_KEY = "train/lr"
RATIO_KEY = "guard/divergence_ratio"
"""In a tripping step's record: the value over its baseline (the largest of the watched metrics')."""
ZERO_LR_KEY = "guard/zero_lr_steps"
"""In a tripping step's record: the steps in a row at a learning rate of 0."""


@dataclass(kw_only=True, frozen=True)
class DivergenceConfig:
    """The divergence guard (``trainer.divergence``): what trips it and what it does then.

    Attributes:
        action: ``warn``: one console warning per episode (tripping steps in a row), the tripping steps'
            ``guard/*`` metrics and ``summary.json``'s ``divergence_guard``; ``stop``: the run ends with an error
            naming the last checkpoint saved before the divergence; ``off``.
        factor: ``train/loss`` or ``train/grad_norm`` above this many times its baseline (the median of its
            last ``window`` values inside the lines), or ``train/grad_norm`` below the baseline divided by it, for
            ``patience`` steps in a row trips the guard. The embedded jobs' default runs would trip only a
            factor under 4.5.
        window: steps the baseline's median is taken over.
        patience: steps in a row a value must stay outside its lines, or the learning rate at 0
            (``optimizer.lr=0``, or an ``optimizer.total_steps`` shorter than the run), to trip the guard.
    """

    action: DivergenceAction = "warn"
    factor: float = 10.0
    window: int = 50
    patience: int = 3

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ConfigError(
                f"trainer.divergence.factor must be > 1 (a multiple of the running baseline), got {self.factor}."
            )
        for name in ("window", "patience"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.divergence.{name} must be >= 1, got {getattr(self, name)}.")


@dataclass(frozen=True)
class Trip:
    """One step that tripped the guard.

    Attributes:
        step: the step (1-based, as in the metric records).
        kind: ``diverged`` (a watched metric above ``factor`` x its baseline), ``collapsed`` (the grad norm below
            its baseline / ``factor``) or ``stalled`` (learning rate 0).
        metric: the metric that tripped it (the one furthest from its baseline when several did).
        value: its value at ``step`` (``stalled``: 0).
        baseline: its baseline (``stalled``: 0).
        since: the first step of the streak that tripped it.
        first: whether this step starts an episode (the previous step did not trip the guard).
    """

    step: int
    kind: TripKind
    metric: str
    value: float
    baseline: float
    since: int
    first: bool

    def record(self) -> dict[str, float]:
        """What the step's metric record gains."""
        if self.kind == "stalled":
            return {ZERO_LR_KEY: float(self.step - self.since + 1)}
        return {RATIO_KEY: self.value / self.baseline}

    def describe(self) -> str:
        """What happened, in one sentence."""
        if self.kind == "stalled":
            return (
                f"step {self.step}: {LR_KEY} has been 0 since step {self.since}, so no update changes the weights "
                "(optimizer.lr=0, or an optimizer.total_steps shorter than the run)"
            )
        where = (
            f"{self.metric}={self.value:.4g} is {self.value / self.baseline:.3g}x its running median "
            f"{self.baseline:.4g} (outside the guard's lines since step {self.since})"
        )
        if self.kind == "collapsed":
            return (
                f"step {self.step}: {where}: the updates have collapsed; a learning rate too high for the model "
                "can make a policy's samples all alike (lower optimizer.lr), or the rewards stopped telling "
                "samples apart"
            )
        return (
            f"step {self.step}: {where}: the run is diverging; the usual cause is a learning rate too high for "
            "the model: lower optimizer.lr"
        )

    def summary(self) -> dict[str, Any]:
        """The trip as ``summary.json`` lists it."""
        return {
            "step": self.step,
            "since": self.since,
            "kind": self.kind,
            "metric": self.metric,
            "value": self.value,
            "baseline": self.baseline,
        }


@dataclass
class _Streak:
    """One watched metric: its recent values inside its line and the steps in a row outside it."""

    history: deque[float]
    outside: int = 0


@dataclass
class DivergenceGuard:
    """The guard's state over one run's step records (the same on every rank: the records are).

    Args:
        config: the ``trainer.divergence`` section.
    """

    config: DivergenceConfig
    episodes: list[Trip] = field(default_factory=list)
    """The first trip of each episode, in order."""
    _streaks: dict[str, _Streak] = field(default_factory=dict)
    _zero_lr_steps: int = 0
    _tripping: bool = False

    def check(self, step: int, values: Mapping[str, Any]) -> Trip | None:
        """Take step ``step``'s record into account; the trip it makes, if any."""
        if self.config.action == "off":
            return None
        diverged, stalled = self._diverged(step, values), self._stalled(step, values)
        trip = diverged or stalled
        if trip is not None and trip.first:
            self.episodes.append(trip)
        self._tripping = trip is not None
        return trip

    def replay(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Take an earlier run's records (a resumed run's ``metrics.jsonl`` up to its step) into account."""
        for record in records:
            if any(key in record for key in (*WATCHED, LR_KEY)):
                self.check(int(record["step"]), record)

    @property
    def tripped(self) -> bool:
        return bool(self.episodes)

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``divergence_guard``: the action, whether it tripped and each episode's first trip."""
        return {
            "action": self.config.action,
            "tripped": self.tripped,
            "episodes": [trip.summary() for trip in self.episodes],
        }

    def _diverged(self, step: int, values: Mapping[str, Any]) -> Trip | None:
        """A trip when a watched metric has been outside its line for ``patience`` steps (the one furthest out
        when several have); every value inside joins its metric's history."""
        tripping: list[tuple[float, str, float, float]] = []
        for metric in WATCHED:
            value = values.get(metric)
            if value is None or not math.isfinite(value):
                continue
            streak = self._streaks.setdefault(metric, _Streak(deque(maxlen=self.config.window)))
            baseline = statistics.median(streak.history) if streak.history else 0.0
            if baseline > 0 and self._outside(metric, value / baseline):
                streak.outside += 1
                if streak.outside >= self.config.patience:
                    tripping.append((abs(math.log(max(value, _TINY) / baseline)), metric, value, baseline))
            else:
                streak.outside = 0
                streak.history.append(value)
        if not tripping:
            return None
        _, metric, value, baseline = max(tripping)
        kind: TripKind = "diverged" if value > baseline else "collapsed"
        since = step - self._streaks[metric].outside + 1
        return Trip(step, kind, metric, value, baseline, since, first=not self._tripping)

    def _outside(self, metric: str, ratio: float) -> bool:
        """Whether ``ratio`` (value over baseline) is above ``factor``, or for a grad norm below its inverse."""
        return ratio > self.config.factor or (metric in COLLAPSING and ratio < 1 / self.config.factor)

    def _stalled(self, step: int, values: Mapping[str, Any]) -> Trip | None:
        """A trip once the learning rate has been 0 for ``patience`` steps in a row."""
        self._zero_lr_steps = self._zero_lr_steps + 1 if values.get(LR_KEY) == 0 else 0
        if self._zero_lr_steps < self.config.patience:
            return None
        since = step - self._zero_lr_steps + 1
        return Trip(step, "stalled", LR_KEY, 0.0, 0.0, since, first=not self._tripping)


__all__ = ["DivergenceAction", "DivergenceConfig", "DivergenceGuard", "Trip", "TripKind"]
