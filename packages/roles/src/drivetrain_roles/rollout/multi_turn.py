"""Multi-turn rollouts: episodes in environments, batched across episodes, token in and token out.

Each turn, every running episode's whole token sequence goes to ``rollout.generate`` in one call (any rollout:
``hf``, ``vllm``, ``vllm-server``); each answer is appended as sampled, ids and log-probs. Then every
environment steps on its turn concurrently (each within ``step_timeout_s``), and what it answered is rendered
by the chat template and appended with loss mask 0 (:mod:`.episode`, :mod:`.chat_rendering`). An episode stops
when its environment says done, at ``max_turns``, at ``max_total_tokens``, when a turn ends without its
end-of-turn token (cut at ``max_new_tokens``: nothing to step on), or when its step fails or times out; the
others go on. A failing step is logged and ends only its episode: a flaky environment does not stop a batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import Environment
from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig

from .episode import Episode
from .trajectory import Trajectory
from .turn_limits import TurnLimits

TURN_SEED_STRIDE = 7_919
"""Turn ``t`` samples with ``sampling.seed + TURN_SEED_STRIDE * t``: distinct per turn, repeatable."""

logger = logging.getLogger(__name__)


def run_episodes(
    rollout: Rollout,
    tokenizer: Any,
    environment: Callable[[], Environment],
    examples: Sequence[Mapping[str, Any]],
    sampling: SamplingConfig,
    limits: TurnLimits | None = None,
    on_turn: Callable[[RolloutOutput], None] | None = None,
) -> list[Trajectory]:
    """``sampling.n`` episodes per example, prompt-major (episode ``i`` is of example ``i // n``), each in a
    fresh ``environment()``. Not from a running event loop: await :func:`run_episodes_async` there.

    Args:
        rollout: samples every turn (``sampling.max_new_tokens`` is one turn's limit; its ``stop_token_ids``
            should hold the chat template's end-of-turn token, e.g. ``<|im_end|>``).
        tokenizer: the model's tokenizer, with the chat template observations are rendered by.
        environment: builds one environment per episode (:func:`drivetrain_engine_core.job.environment_factory`
            for a registered one).
        examples: data set rows, handed to ``Environment.reset``.
        sampling: how each turn samples.
        limits: turns, tokens and step time per episode (default :class:`TurnLimits`).
        on_turn: called with each turn's ``generate`` output (a progress bar counts its tokens).
    """
    return asyncio.run(
        run_episodes_async(rollout, tokenizer, environment, examples, sampling, limits, on_turn)
    )


async def run_episodes_async(
    rollout: Rollout,
    tokenizer: Any,
    environment: Callable[[], Environment],
    examples: Sequence[Mapping[str, Any]],
    sampling: SamplingConfig,
    limits: TurnLimits | None = None,
    on_turn: Callable[[RolloutOutput], None] | None = None,
) -> list[Trajectory]:
    """:func:`run_episodes` as a coroutine."""
    limits = limits or TurnLimits()
    if sampling.record_routed_experts:
        raise ConfigError(
            "multi-turn rollouts do not record routed experts yet (each turn is its own generate call): set "
            "rollout.router_replay=disabled for environments."
        )
    episodes = [Episode(environment(), example) for example in examples for _ in range(sampling.n)]
    try:
        await asyncio.gather(*(_start(e, tokenizer, limits) for e in episodes))
        end_ids = {*sampling.stop_token_ids, *_ids(tokenizer.eos_token_id)}
        for turn in range(limits.max_turns):
            running = [e for e in episodes if e.running]
            if not running:
                break
            output = _sample_turn(rollout, running, sampling, limits, turn, end_ids, tokenizer)
            if on_turn is not None:
                on_turn(output)
            stepping = [e for e in running if e.running]
            await asyncio.gather(*(_step(e, tokenizer, limits, turn) for e in stepping))
    finally:
        await asyncio.gather(*(_close(e, limits) for e in episodes))
    version = rollout.weights_version or 0
    return [e.trajectory(version) for e in episodes]


async def _start(episode: Episode, tokenizer: Any, limits: TurnLimits) -> None:
    """Reset the episode's environment within ``step_timeout_s``: an episode that cannot start has no
    trajectory, so a hung reset is an error, not a stopped episode."""
    try:
        await asyncio.wait_for(episode.start(tokenizer, limits.max_total_tokens), limits.step_timeout_s)
    except TimeoutError as e:
        raise TimeoutError(
            f"environment {type(episode.environment).__name__}: reset() took longer than step_timeout_s="
            f"{limits.step_timeout_s:g} s; check that it can start (a server it needs, a sandbox) or raise "
            "the limit."
        ) from e


def _sample_turn(
    rollout: Rollout,
    running: list[Episode],
    sampling: SamplingConfig,
    limits: TurnLimits,
    turn: int,
    end_ids: set[int],
    tokenizer: Any,
) -> RolloutOutput:
    """One ``generate`` call for every running episode; each turn appended as sampled, cut to its budget.
    Returns the call's output."""
    budgets = [limits.max_total_tokens - len(e.ids) for e in running]
    most = min(sampling.max_new_tokens, max(budgets))
    turn_sampling = dataclasses.replace(
        sampling, n=1, max_new_tokens=most, seed=sampling.seed + TURN_SEED_STRIDE * turn
    )
    output = rollout.generate([e.ids for e in running], turn_sampling)
    version = output.version or 0
    for episode, budget, ids, log_probs in zip(
        running, budgets, output.responses, output.log_probs, strict=True
    ):
        sampled = ids.tolist()
        ended = len(sampled) < most or sampled[-1] in end_ids
        episode.add_turn(sampled[:budget], log_probs[:budget].tolist(), version)
        if len(sampled) > budget or (not ended and len(sampled) == budget):
            episode.stop("max_total_tokens")
        elif not ended:
            episode.stop("truncated")
        else:
            episode.end_of_turn = tokenizer.decode([sampled[-1]])
    return output


async def _step(episode: Episode, tokenizer: Any, limits: TurnLimits, turn: int) -> None:
    """The environment's answer to the episode's last turn, appended (or why the episode stops)."""
    try:
        result = await asyncio.wait_for(
            episode.environment.step(episode.model_turn(tokenizer)), limits.step_timeout_s
        )
    except TimeoutError:
        episode.stop("step_timeout", {"error": f"the step took longer than {limits.step_timeout_s:g} s"})
        return
    except TypeError:  # a broken contract (Environment.step's checks) is a bug to fix, not noise
        raise
    except Exception as error:
        logger.warning(
            "environment %s failed on turn %d: %r", type(episode.environment).__name__, turn, error
        )
        episode.stop("step_error", {"error": f"{type(error).__name__}: {error}"})
        return
    episode.record(result)
    if result.done:
        episode.stop("done")
    elif turn + 1 == limits.max_turns:
        episode.stop("max_turns")
    else:
        episode.add_observation(result.observation, limits.max_total_tokens)


async def _close(episode: Episode, limits: TurnLimits) -> None:
    try:
        await asyncio.wait_for(episode.environment.close(), limits.step_timeout_s)
    except Exception as error:
        logger.warning("closing environment %s failed: %r", type(episode.environment).__name__, error)


def _ids(value: int | Sequence[int] | None) -> list[int]:
    return [value] if isinstance(value, int) else list(value or [])
