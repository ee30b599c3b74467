"""``say-the-word``: the model is asked to say a data row's word, then asked again, ``turns`` times in all.

Each turn earns :func:`letter_share` of the word less one half: graded, and negative for a turn that holds fewer
than half of the word's letters, so a group of episodes differs in reward long before any says the word.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import Environment, Message, ModelTurn, StepResult

AGAIN = "Again."
"""What the game says after every turn but the last."""


def letter_share(word: str, text: str) -> float:
    """The share of ``word``'s distinct letters that ``text`` holds, in [0, 1]."""
    letters = set(word)
    return len(letters & set(text)) / len(letters)


class SayTheWord(Environment):
    """One episode of the game (a rollout builds one per episode).

    Args:
        turns: how many turns an episode lasts (``environment.options.turns``).
    """

    def __init__(self, *, turns: int = 2) -> None:
        if turns < 1:
            raise ConfigError(f"say-the-word: turns={turns} must be >= 1; set environment.options.turns=2.")
        self.turns = turns
        self.word = ""

    def _reset(self, example: Mapping[str, Any]) -> list[Message]:
        word = example.get("word")
        if not isinstance(word, str) or not word:
            raise ConfigError(
                f"say-the-word needs rows with a 'word' (a non-empty string); this row has {sorted(example)}. "
                'Add one, e.g. {"prompt": "Say sit.", "word": "sit"}.'
            )
        self.word = word
        return [{"role": "user", "content": f"Say {word}."}]

    def _step(self, turn: ModelTurn) -> StepResult:
        done = turn.turn + 1 >= self.turns
        return StepResult(
            observation=[] if done else [{"role": "user", "content": AGAIN}],
            reward=letter_share(self.word, turn.text) - 0.5,
            done=done,
        )
