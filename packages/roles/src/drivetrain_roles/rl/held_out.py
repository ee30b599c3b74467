"""Held-out evaluation of a policy job (``grpo``, ``ppo``): greedy answers to the first ``trainer.eval_samples``
held-out prompts through the rollout (the synced weights), scored by the reward functions as in training.

- ``val/accuracy``: the fraction of answers that are exactly the reference (none without references,
  ``data.response_key=null``);
- ``val/reward``: the mean reward, the functions' weighted sum (with ``exact_match`` alone the same number as
  ``val/accuracy``), plus the environment's reward in an environment;
- ``val/reward/<name>``: each entry of ``algorithm.reward_functions`` (function or reward model), its mean over
  the answers it applies to, unweighted (as ``reward/<name>`` is in training).

In an environment (``environment.name``) each prompt is one greedy episode: its answer is its last model turn,
its episode the functions' ``trajectory``. The prompts are split over the ranks. The generation shows a bar of its
new tokens on rank 0's terminal (:func:`~..jobs.progress.generation_progress`), moved by each ``generate`` call:
each turn of the episodes, or each slice of the prompts.

NOTE: a rollout reports nothing before its ``generate`` call returns, so single-turn prompts are generated in
slices of at most a training step's rows per rank (``trainer.prompts_per_step x rollout.n / ranks``): no call is
larger than the ones training makes, and a held-out set larger than that shows its progress.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drivetrain_engine_core.job import agreed_checks
from drivetrain_engine_core.kit import distributed
from drivetrain_engine_core.rollout import Rollout, RolloutOutput, SamplingConfig

from ..jobs.data import Example
from ..jobs.progress import generation_progress
from ..reward_model.scorer import RewardModel
from ..rollout.trajectory import Trajectory
from .episodes import EpisodePipeline, final_turns
from .hooks import Sampler
from .job_config import PolicyJobConfig
from .rewards import applied_means, applied_sums, exact_match
from .scoring import answer_rewards


def held_out_evaluation(
    samples: Sequence[Example],
    sampler: Sampler,
    tokenizer: Any,
    config: PolicyJobConfig,
    models: Mapping[str, RewardModel] | None = None,
) -> dict[str, float]:
    """The module's values over ``samples`` (collective: every rank gets them), answered through ``sampler``'s
    rollout and scored with the job's reward ``models``; empty without samples."""
    if not samples:
        return {}
    names = config.algorithm.rewards().names
    local = samples[distributed.rank() :: distributed.world_size()]
    sums = [0.0] * (2 + 2 * len(names))
    with agreed_checks():
        if local:
            sums = _local_sums(local, sampler, tokenizer, config, models)
    correct, reward, *functions = distributed.all_reduce_sums(sums)
    accuracy = {"val/accuracy": correct / len(samples)} if samples[0].has_reference else {}
    return {**accuracy, "val/reward": reward / len(samples), **applied_means("val/reward/", names, functions)}


def _local_sums(
    examples: Sequence[Example],
    sampler: Sampler,
    tokenizer: Any,
    config: PolicyJobConfig,
    models: Mapping[str, RewardModel] | None,
) -> list[float]:
    """This rank's exact answers, total reward and :func:`~.rewards.applied_sums` of ``examples``."""
    output, trajectories = greedy_answers(examples, sampler, config)
    answers, scores = answer_rewards(
        examples, output, tokenizer, config.algorithm.rewards(), models, trajectories
    )
    correct = sum(exact_match(a, e.response_text) for a, e in zip(answers, examples, strict=True))
    environment = sum(t.reward for t in trajectories or ())
    return [correct, float(scores.total.sum()) + environment, *applied_sums(scores)]


def greedy_answers(
    examples: Sequence[Example], sampler: Sampler, config: PolicyJobConfig
) -> tuple[RolloutOutput, list[Trajectory] | None]:
    """The greedy response to each of ``examples`` and, in an environment, the episodes whose last model turns
    they are (``None`` without one); the generation's progress on the bar."""
    rollout_section, environment = config.rollout, config.environment
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=rollout_section.max_new_tokens)
    turns = environment.max_turns if isinstance(sampler, EpisodePipeline) else 1
    total = len(examples) * turns * rollout_section.max_new_tokens
    with (
        sampler.exclusive() as rollout,
        generation_progress(total, enabled=config.trainer.progress_bar) as bar,
    ):

        def count(output: RolloutOutput) -> None:
            bar.update(sum(len(response) for response in output.responses))

        if isinstance(sampler, EpisodePipeline):
            trajectories = sampler.episodes([e.columns for e in examples], sampling, count)
            return final_turns(trajectories, 1, rollout.weights_version or 0), trajectories
        rows = max(1, config.trainer.prompts_per_step * rollout_section.n // distributed.world_size())
        return _sliced(rollout, [e.prompt_ids for e in examples], sampling, rows, count), None


def _sliced(
    rollout: Rollout,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    rows: int,
    count: Callable[[RolloutOutput], None],
) -> RolloutOutput:
    """``rollout.generate`` over ``prompts`` in slices of ``rows``, ``count`` told of each, joined in order."""
    outputs = []
    for start in range(0, len(prompts), rows):
        outputs.append(rollout.generate(prompts[start : start + rows], sampling))
        count(outputs[-1])
    return RolloutOutput(
        responses=[r for output in outputs for r in output.responses],
        log_probs=[p for output in outputs for p in output.log_probs],
        version=outputs[-1].version,
        n=sampling.n,
    )
