"""The ``environment`` section of ``drivetrain grpo`` and ``drivetrain ppo``: which registered environment the
policy acts in over several turns, with what options and within which limits (none: one prompt, one response)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from drivetrain_engine_core.backend import ConfigError

if TYPE_CHECKING:
    from ..rollout.turn_limits import TurnLimits


@dataclass(kw_only=True, frozen=True)
class EnvironmentConfig:
    """A multi-turn environment to train in (``environment.name=<registered name>``; see ``drivetrain plugins``).

    Attributes:
        name: the registered environment; ``None``: single-turn sampling (the default).
        options: the environment's constructor arguments, ``environment.options.<key>=<value>``.
        max_turns: model turns per episode at most.
        max_total_tokens: tokens of a whole episode at most (prompt, turns, observations); each turn is also
            limited by ``rollout.max_new_tokens``.
        step_timeout_s: how long one environment step may take before its episode ends.
        stop_tokens: the chat template's end-of-turn tokens: a turn ends at one (the model's end-of-sequence
            token always ends it too).
    """

    name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int = 4096
    step_timeout_s: float = 60.0
    stop_tokens: tuple[str, ...] = ("<|im_end|>",)

    def __post_init__(self) -> None:
        self.limits()  # the limits' own checks, named by these keys

    @property
    def enabled(self) -> bool:
        return self.name is not None

    def limits(self) -> TurnLimits:
        """The episode's limits as the multi-turn rollout takes them."""
        from ..rollout.turn_limits import TurnLimits

        try:
            return TurnLimits(
                max_turns=self.max_turns,
                max_total_tokens=self.max_total_tokens,
                step_timeout_s=self.step_timeout_s,
            )
        except ConfigError as e:
            raise ConfigError(f"environment.max_turns/max_total_tokens/step_timeout_s: {e}") from e

    def stop_token_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The ids of ``stop_tokens`` in ``tokenizer``'s vocabulary.

        Raises:
            ConfigError: a stop token the tokenizer does not hold as one token.
        """
        vocabulary = tokenizer.get_vocab()
        missing = [t for t in self.stop_tokens if t not in vocabulary]
        if missing:
            raise ConfigError(
                f"environment.stop_tokens={list(self.stop_tokens)}: {missing} is not a token of the model's "
                "tokenizer; set environment.stop_tokens to its chat template's end-of-turn token (e.g. "
                "[<|im_end|>] for ChatML, [<|eot_id|>] for Llama 3)."
            )
        return tuple(vocabulary[t] for t in self.stop_tokens)
