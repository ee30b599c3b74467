"""A user's own measures of the held-out greedy answers (``trainer.eval_metrics`` of ``sft`` and ``dpo``).

Held-out evaluation measured the loss and exact match only; a user could not plug in their own measure (TRL's
``compute_metrics``, a reward function scored on held-out generations). A measure is written as a reward
function is (``algorithm.reward_function``): a built-in (``exact_match``, ``math_verify``, ``step_credit``),
``package.module:function`` or ``path/to/file.py:function``, called with the keywords its signature names
(``prompts``, ``completions``, ``references``, the data set's columns) and returning one number per answer, or
``None`` where it does not apply. Each is reported as ``val/<name>``, its mean over the answers it applies to,
in ``metrics.jsonl`` and on the curve under the loss.

NOTE: the functions are loaded and run by the reward machinery of ``grpo`` (one loader, one signature reader,
one runner with its timeout), so a reward function and a metric are the same kind of object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError

from .jobs.curves import Panel, Series
from .jobs.data import Example
from .rl.reward_inputs import RewardInputs
from .rl.reward_runner import Outcome, run_rewards
from .rl.reward_settings import RewardSettings, reward_names
from .rl.reward_signatures import LoadedReward, RewardError
from .rl.rewards import load_rewards, refuse_missing_keywords

TIMEOUT_S = 300.0
"""How long the measures may take together over one evaluation's answers."""

RESERVED = ("loss", "perplexity", "accuracy", "dpo_loss")
"""Names of the held-out measures a job reports itself: a metric of that name would overwrite one."""


@dataclass(frozen=True)
class HeldOutMetrics:
    """The measures ``trainer.eval_metrics`` names, loaded; called with the held-out examples and their answers.

    Attributes:
        settings: the functions, as a reward setting of weight 1 each.
    """

    settings: RewardSettings

    @classmethod
    def load(cls, specs: Sequence[str]) -> HeldOutMetrics | None:
        """The measures ``specs`` name, loaded and checked now (``None`` for none), so a wrong name fails
        before the first step.

        Raises:
            ConfigError: a measure that cannot load, is named twice, takes a name the job reports itself, or is
                a reward model's folder (``sft`` and ``dpo`` build no reward model engine).
        """
        if not specs:
            return None
        settings = RewardSettings(functions=tuple(specs), weights=(1.0,) * len(specs), timeout_s=TIMEOUT_S)
        try:
            names = reward_names(settings.functions)
            load_rewards(settings)
        except (ConfigError, RewardError) as e:
            raise ConfigError(f"trainer.eval_metrics={list(specs)}: {e}") from e
        if settings.models:
            raise ConfigError(
                f"trainer.eval_metrics={list(specs)}: {settings.models[0]!r} is a reward model's folder, and "
                "sft and dpo build no engine for one; list reward functions here (a built-in, "
                "package.module:function or path/to/file.py:function), and score with a reward model in "
                "drivetrain grpo or ppo (algorithm.reward_functions, whose held-out answers it scores as "
                "val/reward)."
            )
        taken = [name for name in names if name in RESERVED]
        if taken:
            raise ConfigError(
                f"trainer.eval_metrics={list(specs)}: {taken[0]!r} would overwrite the job's own val/{taken[0]}; "
                "rename the function."
            )
        return cls(settings)

    @property
    def panel(self) -> Panel:
        """The curve's panel of these measures."""
        series = tuple(Series(key=f"val/{name}", label=name, style="o-") for name in self.settings.names)
        return Panel(title="held-out answers: your measures (trainer.eval_metrics)", series=series)

    def __call__(self, examples: Sequence[Example], answers: Sequence[str]) -> dict[str, float]:
        """``val/<name>``: each measure's mean over the answers it applies to (left out where it applies to none).

        Raises:
            RewardError: a measure asks for a keyword the data lacks, returned something unusable, raised or ran
                out of time (the message names the function and the answer).
        """
        rewards = load_rewards(self.settings)
        inputs = RewardInputs.of(examples, list(answers))
        for reward in rewards:
            refuse_missing_keywords(reward, list(inputs.keywords))
        values = {}
        for reward, outcome in zip(
            rewards, run_rewards(rewards, inputs, self.settings.timeout_s), strict=True
        ):
            _refuse_failure(reward, outcome, inputs)
            numbers = [v for v in outcome.values if v is not None]
            if numbers:
                values[f"val/{reward.name}"] = sum(numbers) / len(numbers)
        return values


def _refuse_failure(reward: LoadedReward, outcome: Outcome, inputs: RewardInputs) -> None:
    """A measure that returned something unusable, raised or timed out stops the run with its name and the row."""
    if outcome.invalid is not None:
        raise outcome.invalid
    label = f"trainer.eval_metrics: {reward.name!r} ({reward.spec})"
    if outcome.errors:
        row, error = min(outcome.errors.items())
        raise RewardError(
            f"{label} raised {type(error).__name__}: {error} on {inputs.describe(row)}; fix the function (return "
            "None for an answer it does not apply to)."
        ) from error
    if outcome.timed_out:
        raise RewardError(
            f"{label} did not finish within {TIMEOUT_S:g} s on {inputs.describe(outcome.timed_out[0])}; make it "
            "faster."
        )


__all__ = ["RESERVED", "HeldOutMetrics"]
