"""The rewards of a batch of completions: the functions ``algorithm.reward_functions`` names, run concurrently
(:mod:`.reward_runner`), combined by ``algorithm.reward_weights``.

The combination is TRL's (``GRPOTrainer``: ``(rewards_per_func * reward_weights).nansum(dim=1)``): a completion's
reward is the weighted sum of the functions' values, and a function that returns ``None`` for it (not
applicable) is left out of that sum, not counted as 0 nor renormalised. A completion for which every function
returned ``None`` is refused with an error naming it: TRL's older trainers summed it to 0 with a warning, which
moves its group's baseline and gives it an advantage it never earned; its newer ones drop it from the baseline
and give it no advantage. drivetrain's estimators take no such holes (PPO's critic would still learn a value for
it), so the data or the functions are the place to fix it. Each function's mean over the completions it applies
to is logged as ``reward/<name>`` (TRL's ``rewards/<name>/mean``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.backend import DrivetrainError
from drivetrain_engine_core.kit import distributed
from torch.distributed import ProcessGroup

from ..jobs.data import Example
from ..reward_model.scorer import RewardModel
from ..reward_model.spec import check_model_folder, is_model_spec
from .builtin_rewards import BUILTIN_REWARDS, BUILTIN_SETUP
from .builtin_rewards import EXACT_MATCH as EXACT_MATCH
from .builtin_rewards import RewardFunction as RewardFunction
from .builtin_rewards import exact_match as exact_match
from .builtin_rewards import exact_match_reward as exact_match_reward
from .reward_inputs import TRAJECTORY, RewardInputs, available_keywords
from .reward_runner import MISSING, Outcome, run_rewards
from .reward_settings import RewardSettings, reward_names
from .reward_signatures import LoadedReward, loaded_reward
from .reward_signatures import RewardError as RewardError  # importable from here since 0.1.0


def exact_answer_rewards(answers: Sequence[str], references: Sequence[str]) -> torch.Tensor:
    """``(len(answers),)`` float32: 1 where the answer is exactly the reference, else 0."""
    return torch.tensor(
        [float(exact_match(a, r)) for a, r in zip(answers, references, strict=True)], dtype=torch.float32
    )


@dataclass(frozen=True)
class Scores:
    """A batch's rewards.

    Attributes:
        total: ``(completions,)`` float32, the weighted sum of the functions that apply to each completion.
        values: ``(completions, functions)`` float64, each function's value; NaN where it returned ``None``.
        names: the functions' names in the metrics.
        failed: per function, the completions that scored ``algorithm.reward_failure_value`` because it raised
            or ran out of time; ``None`` when failures stop the run instead.
    """

    total: torch.Tensor
    values: torch.Tensor
    names: tuple[str, ...]
    failed: tuple[int, ...] | None = None


def reward_metrics(scores: Scores | None, group: ProcessGroup | None = None) -> dict[str, float]:
    """``reward/<name>``: each function's mean over the completions it applies to on every rank of ``group``
    (none where it applied to no completion), and ``reward/<name>/failed``: how many scored the failure value
    (collective; none without ``scores``, a batch built from bare rewards)."""
    if scores is None:
        return {}
    failed = list(scores.failed or ())
    reduced = distributed.all_reduce_sums([*applied_sums(scores), *failed], group)
    width = len(scores.names)
    metrics = applied_means("reward/", scores.names, reduced[: 2 * width])
    if scores.failed is not None:
        metrics.update(
            {f"reward/{name}/failed": reduced[2 * width + i] for i, name in enumerate(scores.names)}
        )
    return metrics


def applied_sums(scores: Scores) -> list[float]:
    """Each function's sum over the completions it applies to, then how many those are (``2 x functions``
    numbers, to be summed over ranks and read by :func:`applied_means`)."""
    applies = ~torch.isnan(scores.values)
    return [*torch.where(applies, scores.values, 0.0).sum(dim=0).tolist(), *applies.sum(dim=0).tolist()]


def applied_means(prefix: str, names: Sequence[str], sums: Sequence[float]) -> dict[str, float]:
    """``<prefix><name>``: each function's mean over the completions it applies to, from :func:`applied_sums`'
    numbers (summed over ranks); none for a function that applied to no completion."""
    width = len(names)
    return {f"{prefix}{name}": sums[i] / sums[width + i] for i, name in enumerate(names) if sums[width + i]}


def score_completions(
    settings: RewardSettings, inputs: RewardInputs, models: Mapping[str, RewardModel] | None = None
) -> Scores:
    """Run ``settings``' functions over ``inputs`` and combine them (see the module docstring); its reward model
    entries are scored by the job's built ``models`` (:func:`load_rewards`). Without functions every total is 0
    (an environment's episodes, paid by its reward alone).

    Raises:
        RewardError: a function cannot load, asks for a keyword the data does not offer, returned something
            unusable, raised or ran out of time (unless ``failure_value`` is set), or no function applies to a
            completion.
        DrivetrainError: a reward model entry that ``models`` does not hold.
    """
    rewards = load_rewards(settings, models)
    for reward in rewards:
        refuse_missing_keywords(reward, list(inputs.keywords))
    outcomes = run_rewards(rewards, inputs, settings.timeout_s)
    columns = [_column(r, o, inputs, settings) for r, o in zip(rewards, outcomes, strict=True)]
    values = torch.tensor(
        [
            [float("nan") if v is None else v for v in row]
            for row in zip(*(c for c, _ in columns), strict=True)
        ],
        dtype=torch.float64,
    ).reshape(len(inputs), len(rewards))
    # NOTE: without functions (``reward_functions=[]``) the environment pays every episode: none is unscorable.
    unscorable = torch.isnan(values).all(dim=1).nonzero().flatten().tolist() if rewards else []
    if unscorable:
        more = f" (and {len(unscorable) - 1} more)" if len(unscorable) > 1 else ""
        raise RewardError(
            f"no reward function applies to {inputs.describe(unscorable[0])}{more}: every one of "
            f"{list(settings.names)} returned None (not applicable). A completion needs at least one reward: add a "
            "function that scores such rows, or leave them out of the data."
        )
    weights = torch.tensor(settings.weights, dtype=torch.float64)
    total = (values * weights).nansum(dim=1).float()
    failed = None if settings.failure_value is None else tuple(count for _, count in columns)
    return Scores(total=total, values=values, names=settings.names, failed=failed)


def _column(
    reward: LoadedReward, outcome: Outcome, inputs: RewardInputs, settings: RewardSettings
) -> tuple[list[float | None], int]:
    """One function's values (the failure value where it failed) and how many failed."""
    if outcome.invalid is not None:
        raise outcome.invalid
    failures = len(outcome.errors) + len(outcome.timed_out)
    if failures and settings.failure_value is None:
        cause = min(outcome.errors.items())[1] if outcome.errors else None
        raise _failure(reward, outcome, inputs, settings) from cause
    return [settings.failure_value if v is MISSING else v for v in outcome.values], failures


def _failure(
    reward: LoadedReward, outcome: Outcome, inputs: RewardInputs, settings: RewardSettings
) -> RewardError:
    fix = (
        "or set algorithm.reward_failure_value (e.g. 0) to score such completions with it, counted in "
        f"reward/{reward.name}/failed."
    )
    label = f"reward function {reward.name!r} ({reward.spec})"
    if outcome.errors:
        row, error = min(outcome.errors.items())
        more = f" (and on {len(outcome.errors) - 1} more)" if len(outcome.errors) > 1 else ""
        return RewardError(
            f"{label} raised {type(error).__name__}: {error} on {inputs.describe(row)}{more}; fix it, {fix}"
        )
    late = outcome.timed_out
    return RewardError(
        f"{label} did not finish within algorithm.reward_timeout_s={settings.timeout_s:g} s: {len(late)} of "
        f"{len(inputs)} completions have no reward, the first {inputs.describe(late[0])}; raise "
        f"algorithm.reward_timeout_s, make the function faster, {fix}"
    )


def check_reward_inputs(
    settings: RewardSettings, examples: Sequence[Example], *, episodes: bool = False
) -> None:
    """Refuse, once the data has loaded and before the first step, a function that asks for a keyword the data
    does not offer (:func:`.reward_inputs.available_keywords`; ``episodes``: a multi-turn job's, which offers
    ``trajectory``).

    Raises:
        RewardError: as :func:`refuse_missing_keywords`.
    """
    available = available_keywords(examples, episodes=episodes)
    for reward in load_rewards(settings):
        refuse_missing_keywords(reward, available)


MISSING_HINTS = {
    "references": "references: the data has no reference answers, data.response_key=null",
    TRAJECTORY: f"{TRAJECTORY}: only a multi-turn job has episodes; set environment.name",
}
"""Why a keyword drivetrain computes can be missing, said beside its name."""


def refuse_missing_keywords(reward: LoadedReward, available: Sequence[str]) -> None:
    """Refuse ``reward`` when it needs keywords that ``available`` (drivetrain's and the data set's) lacks.

    Raises:
        RewardError: naming the missing keywords, what there is, and the fix.
    """
    missing = reward.missing(available)
    if not missing:
        return
    hint = "".join(f" ({why})" for keyword, why in MISSING_HINTS.items() if keyword in missing)
    raise RewardError(
        f"reward function {reward.name!r} ({reward.spec}) asks for {missing}, which the data does not offer{hint}; "
        f"a reward function gets any of {list(available)} (drivetrain's keywords and the data set's columns). "
        "Rename the parameter to one of them, give it a default, or add the column to the data."
    )


def load_rewards(
    settings: RewardSettings, models: Mapping[str, RewardModel] | None = None
) -> list[LoadedReward]:
    """``settings``' functions, each under its metric name (:func:`.reward_settings.reward_names`), each reward
    model entry bound to its model in ``models`` (the job's, built at its set-up: ``reward_model.build``).

    A reward model entry that ``models`` lacks (none given: the config checks, and the Ray controllers, which
    build no reward model) loads as a placeholder that raises, when scored, the error naming where reward
    models run.
    """
    names = reward_names(settings.functions)
    built = models or {}
    return [
        _bound(dataclasses.replace(load_reward_function(spec), name=name), built)
        for spec, name in zip(settings.functions, names, strict=True)
    ]


def _bound(reward: LoadedReward, models: Mapping[str, RewardModel]) -> LoadedReward:
    """``reward`` scored by its model in ``models`` where it is a reward model entry (collective) found there."""
    if reward.collective and reward.spec in models:
        return dataclasses.replace(reward, function=models[reward.spec])
    return reward


def _unbuilt_model(spec: str) -> Callable[..., list[float]]:
    """The placeholder of the reward model ``spec`` where the job built none: raises when scored."""

    def reward_model(**keywords: Any) -> list[float]:
        raise DrivetrainError(
            f"the reward model {spec!r} has no engine in this job: drivetrain grpo and ppo build it at set-up "
            "and hand it to their scorer, the Ray controllers (ColocatedGRPO and its kin) do not yet; run the "
            "command (drivetrain grpo / drivetrain ppo), or score with a reward function there."
        )

    return reward_model


@cache
def load_reward_function(spec: str) -> LoadedReward:
    """The reward function ``spec`` names: a built-in (:data:`BUILTIN_REWARDS`), ``package.module:function``,
    ``path/to/file.py:function`` (verl's custom reward function: a file and a name), or a reward model's folder
    (:mod:`..reward_model`: every keyword; a placeholder here, bound to the job's built model by
    :func:`load_rewards`), loaded once per process, with what its signature asks for (:mod:`.reward_signatures`).

    Raises:
        RewardError: the module or file cannot be imported, has no callable of that name, a built-in's package is
            missing, or the callable's parameters cannot be given by keyword.
        ConfigError: a reward model's folder holds no one-label sequence-classification model.
    """
    if spec in BUILTIN_REWARDS:
        _set_up_builtin(spec)
        return loaded_reward(BUILTIN_REWARDS[spec], spec, spec)
    if is_model_spec(spec):
        check_model_folder(spec)
        return LoadedReward(
            spec, spec, _unbuilt_model(spec), parameters=None, required=frozenset(), collective=True
        )
    location, _, name = spec.rpartition(":")
    try:
        module = (
            _import_file(Path(location)) if location.endswith(".py") else importlib.import_module(location)
        )
    except Exception as e:
        raise RewardError(
            f"algorithm.reward_function={spec!r}: importing {location!r} failed ({type(e).__name__}: {e}); give an "
            "importable module (package.module:function) or a Python file (path/to/file.py:function)."
        ) from e
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardError(
            f"algorithm.reward_function={spec!r}: {location!r} has no function {name!r}; define "
            f"{name}(*, prompts, completions, references) returning one number per completion."
        )
    return loaded_reward(function, spec, name)


def _set_up_builtin(spec: str) -> None:
    if spec not in BUILTIN_SETUP:
        return
    set_up, extra = BUILTIN_SETUP[spec]
    try:
        set_up()
    except ImportError as e:
        raise RewardError(
            f"the built-in reward {spec!r} needs a package that is not installed ({e}); install it with "
            f'pip install "{extra}".'
        ) from e


def _import_file(path: Path) -> object:
    """Import a Python file as a module, registered in ``sys.modules`` as an import would (a ``@dataclass`` in it
    looks its module up there, and pickling its functions needs it)."""
    spec = importlib.util.spec_from_file_location(f"drivetrain_reward_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def compute_rewards(
    spec: str, *, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str]
) -> torch.Tensor:
    """``(len(completions),)`` float32 rewards of the one function ``spec`` names, from texts alone.

    Raises:
        RewardError: as :func:`score_completions`.
    """
    inputs = RewardInputs.of_texts(prompts, completions, references)
    return score_completions(RewardSettings.single(spec), inputs).total
