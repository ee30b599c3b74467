"""Sampling a step as multi-turn episodes in an environment (``environment.name``): the :class:`~.hooks.Sampler`
that ``grpo`` and ``ppo`` train on trajectories through.

:class:`EpisodePipeline` is the rollout pipeline of :mod:`.pipeline` with episodes in place of one ``generate``
call: every turn of a step's episodes runs under the pipeline's rollout lock, so the weight hand-off waits for
the episodes in flight (in ``sync`` mode they run in the step; ahead of it in the asynchronous ones), and each
model token keeps the version that sampled it (``token_versions``). Its :class:`EpisodeBatch` carries the
trajectories, and as its ``output`` each episode's final model turn: what reward functions score.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from drivetrain_engine_core.job import Environment, environment_factory
from drivetrain_engine_core.kit import distributed
from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig

from ..rollout.multi_turn import run_episodes
from ..rollout.trajectory import Trajectory
from ..rollout.turn_limits import TurnLimits
from .environment_config import EnvironmentConfig
from .pipeline import GeneratedBatch, Request, RolloutPipeline

STOP_REASONS = ("done", "max_turns", "max_total_tokens", "truncated", "step_timeout", "step_error")
"""Why an episode ends (:class:`~drivetrain_roles.rollout.trajectory.Trajectory`'s ``stop_reason``)."""


@dataclass(frozen=True)
class EpisodeBatch(GeneratedBatch):
    """One step's episodes; ``output`` holds each episode's final model turn (ids and log-probs).

    Attributes:
        trajectories: the episodes, prompt-major (``output.n`` per example).
    """

    trajectories: tuple[Trajectory, ...] = ()

    def metrics(self, group: Any = None) -> dict[str, float]:
        """Over every rank of ``group`` (collective): ``rollout/turns`` (model turns per episode),
        ``rollout/stop_<reason>`` (the fraction of episodes that ended so), ``rollout/tool_calls`` and
        ``rollout/tool_errors`` (per episode, from the steps' ``info``)."""
        reasons = Counter(t.stop_reason for t in self.trajectories)
        infos = [info for t in self.trajectories for info in t.infos]
        count, turns, calls, errors, *stops = distributed.all_reduce_sums(
            [
                len(self.trajectories),
                sum(t.num_turns for t in self.trajectories),
                sum(float(info.get("tool_calls", 0)) for info in infos),
                sum(float(info.get("tool_errors", 0)) for info in infos),
                *(reasons[r] for r in STOP_REASONS),
            ],
            group,
        )
        count = max(count, 1)
        return {
            "rollout/turns": turns / count,
            **{f"rollout/stop_{r}": stop / count for r, stop in zip(STOP_REASONS, stops, strict=True)},
            "rollout/tool_calls": calls / count,
            "rollout/tool_errors": errors / count,
        }


def final_turns(trajectories: Sequence[Trajectory], n: int, version: int) -> RolloutOutput:
    """Each episode's last model turn as a rollout's output (what reward functions score)."""
    spans = [t.turn_spans[-1] if t.turn_spans else (0, 0) for t in trajectories]
    return RolloutOutput(
        responses=[t.input_ids[a:b] for t, (a, b) in zip(trajectories, spans, strict=True)],
        log_probs=[t.log_probs[a:b] for t, (a, b) in zip(trajectories, spans, strict=True)],
        version=version,
        n=n,
    )


class EpisodePipeline(RolloutPipeline):
    """:class:`~.pipeline.RolloutPipeline` whose batches are episodes in ``environment`` (one per response).

    Args:
        rollout: the rollout, serving ``version``.
        request: the sampling of a step (its prompts are unused: episodes start from ``rows``).
        rows: the data set rows of a step, handed to each episode's ``reset``.
        tokenizer: renders observations with the model's chat template.
        environment: builds one environment per episode.
        limits: turns, tokens and step time per episode.
        stop_token_ids: the chat template's end-of-turn tokens.
        version, first, last, lag: as :class:`~.pipeline.RolloutPipeline`.
    """

    def __init__(
        self,
        rollout: Rollout,
        request: Request,
        *,
        rows: Callable[[int], Sequence[Mapping[str, Any]]],
        tokenizer: Any,
        environment: Callable[[], Environment],
        limits: TurnLimits,
        stop_token_ids: tuple[int, ...],
        version: int,
        first: int,
        last: int,
        lag: int | None,
    ) -> None:
        self.rows, self.tokenizer, self.environment = rows, tokenizer, environment
        self.limits, self.stop_token_ids = limits, stop_token_ids
        super().__init__(rollout, request, version=version, first=first, last=last, lag=lag)

    @classmethod
    def configured(
        cls,
        config: EnvironmentConfig,
        rollout: Rollout,
        request: Request,
        *,
        rows: Callable[[int], Sequence[Mapping[str, Any]]],
        tokenizer: Any,
        version: int,
        first: int,
        last: int,
        lag: int | None,
    ) -> EpisodePipeline:
        """The pipeline of the ``environment`` section ``config`` (its name, options, limits, stop tokens)."""
        assert config.name is not None
        return cls(
            rollout,
            request,
            rows=rows,
            tokenizer=tokenizer,
            environment=environment_factory(config.name, config.options),
            limits=config.limits(),
            stop_token_ids=config.stop_token_ids(tokenizer),
            version=version,
            first=first,
            last=last,
            lag=lag,
        )

    def _generate(self, step: int) -> GeneratedBatch:
        _, sampling = self.request(step)
        rows = self.rows(step)
        with self._rollout_lock:
            version = self._version
            started = time.perf_counter()
            trajectories = self.episodes(rows, sampling)
            finished = time.perf_counter()
        return EpisodeBatch(
            step=step,
            output=final_turns(trajectories, sampling.n, version),
            version=version,
            started=started,
            finished=finished,
            trajectories=tuple(trajectories),
        )

    def episodes(
        self,
        rows: Sequence[Mapping[str, Any]],
        sampling: SamplingConfig,
        on_turn: Callable[[RolloutOutput], None] | None = None,
    ) -> list[Trajectory]:
        """``sampling.n`` episodes from each of ``rows``, the template's turn ends added to the stop tokens
        (``on_turn``: as :func:`~..rollout.multi_turn.run_episodes`'); the caller holds the rollout (the step's
        lock, or :meth:`exclusive` for held-out episodes)."""
        stops = tuple(sorted({*sampling.stop_token_ids, *self.stop_token_ids}))
        sampling = dataclasses.replace(sampling, stop_token_ids=stops)
        return run_episodes(
            self.rollout, self.tokenizer, self.environment, rows, sampling, self.limits, on_turn
        )


def episode_versions(trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
    """The weight version of each episode's model tokens (what the staleness of an episode is measured on)."""
    return [t.versions[t.loss_mask] for t in trajectories]
