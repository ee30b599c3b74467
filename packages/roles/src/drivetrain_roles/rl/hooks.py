"""The parts of an RL step a job plugs in, one protocol each: what samples a step's responses and what scores them.

:class:`~.policy_trainer.PolicyTrainer` owns the step's sequence (sample -> score -> update -> hand off) and asks
its factory methods for these parts: ``make_sampler`` for the :class:`Sampler` (default: the rollout pipeline of
:mod:`.pipeline`, single-turn generation in step or ahead of it) and ``make_scorer`` for the :class:`Scorer`
(default: the reward functions of ``algorithm.rewards()``, :class:`.scoring.RewardScorer`). A multi-turn
sampler or a reward model is a new part returned there; ``grpo`` and ``ppo`` take whatever the base gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from drivetrain_engine_core.rollout import Rollout, RolloutOutput

    from ..jobs.data import Example
    from ..rollout.trajectory import Trajectory
    from .pipeline import GeneratedBatch
    from .rewards import Scores

T = TypeVar("T")


class Sampler(Protocol):
    """Produces each step's responses from the rollout; made once the start step is known.

    Called on the trainer's thread in this order per step: :meth:`take`, then :meth:`update` with the hand-off;
    :meth:`exclusive` whenever evaluation generates, :meth:`close` once at the end (also after a failure).
    """

    def take(self, step: int) -> GeneratedBatch:
        """The responses of ``step`` (steps are taken in order) and the weight version that generated them."""
        ...

    def update(self, hand_off: Callable[[], T], version: int) -> T:
        """Run ``hand_off`` (collective: it makes the rollout serve ``version``) when no generation is in flight;
        returns what it returns (the sync's metrics)."""
        ...

    def exclusive(self) -> AbstractContextManager[Rollout]:
        """The rollout, with no step's generation running meanwhile (evaluation's greedy answers)."""
        ...

    def overlap(self, start: float, end: float) -> float:
        """Seconds of generation that ran within ``[start, end]`` (0 when generation never runs ahead)."""
        ...

    def close(self) -> None:
        """Stop generating; batches not taken are discarded."""
        ...


class Scorer(Protocol):
    """Scores a step's responses; called on every data-parallel rank with its own share, inside agreed checks
    (an error on one rank is raised on all). Must not run collectives of its own."""

    def __call__(
        self,
        examples: Sequence[Example],
        output: RolloutOutput,
        trajectories: Sequence[Trajectory] | None = None,
    ) -> Scores:
        """Each response's score (``output.n`` per example, prompt-major) and each component's values; in a
        multi-turn job ``output`` holds each episode's final model turn and ``trajectories`` the episodes."""
        ...


__all__ = ["Sampler", "Scorer"]
