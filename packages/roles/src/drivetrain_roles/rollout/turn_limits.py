"""How far a multi-turn episode may run: turns, tokens and time per environment step."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError


@dataclass(kw_only=True, frozen=True)
class TurnLimits:
    """Limits of one episode (each turn's own length is the sampling's ``max_new_tokens``).

    Attributes:
        max_turns: model turns at most; the episode stops after that many, whatever the environment says.
        max_total_tokens: tokens of the whole trajectory at most (prompt, turns and observations); a turn is cut
            to what is left, and an observation that would not leave room for one more token ends the episode.
        step_timeout_s: how long one environment step (one ``step`` call, its tools included) may take; a step
            that takes longer ends its episode (``stop_reason="step_timeout"``) and the others go on. A
            ``reset`` that takes longer is a ``TimeoutError`` (an episode that cannot start has no trajectory).
    """

    max_turns: int = 4
    max_total_tokens: int = 4096
    step_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 2 or not self.step_timeout_s > 0:
            raise ConfigError(
                f"multi-turn limits need max_turns >= 1, max_total_tokens >= 2 and step_timeout_s > 0, got "
                f"max_turns={self.max_turns}, max_total_tokens={self.max_total_tokens}, "
                f"step_timeout_s={self.step_timeout_s}."
            )
