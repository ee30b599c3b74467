"""Conversation pieces as token ids, rendered by the model's chat template: the first prompt of an episode and,
after each model turn, only what the environment added (the delta).

NOTE: the delta, not the whole conversation again. Rendering the whole conversation and cutting the old part
off re-tokenises the model's own turns from their text (a turn sampled as ``i``, ``s`` comes back as ``is``),
and templates rewrite earlier turns (Qwen3 drops past ``<think>`` blocks). The delta is rendered against a
fixed stand-in conversation that ends in an assistant turn: what the template writes after that turn's
end-of-turn token (ChatML's newline) and for the new messages, up to the next generation prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import Message

STAND_IN: tuple[Message, ...] = (
    {"role": "user", "content": "question"},
    {"role": "assistant", "content": "answer"},
)
"""The conversation deltas are rendered after: a user turn and the assistant turn the model just ended."""


class ChatRenderer:
    """Token ids of chat messages under ``tokenizer``'s chat template, with the tools of one episode.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: JSON tool schemas the template shows (``None`` or empty: no tools).
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"multi-turn rollouts render observations with the tokenizer's chat template, and "
                f"{type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '?')}) has none; use a chat "
                "model's tokenizer or set tokenizer.chat_template."
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._stand_in = self._render(list(STAND_IN), add_generation_prompt=False)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the episode's first conversation, ending in the generation prompt."""
        return self._ids(self._render(list(messages), add_generation_prompt=True))

    def delta_ids(self, observation: Sequence[Message], end_of_turn: str | None) -> list[int]:
        """The ids that follow a model turn ended by the token ``end_of_turn`` (its text; ``None``: the turn
        ended otherwise): the template's text after that token, ``observation`` and the generation prompt.

        Raises:
            ConfigError: the template renders the stand-in conversation differently once messages follow it
                (the delta is then not defined).
        """
        before = self._stand_in
        after = self._render([*STAND_IN, *observation], add_generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError(
                "the chat template renders a conversation's earlier turns differently once more messages follow, "
                f"so what an observation adds is not defined: {before[-80:]!r} is not a prefix of {after[:200]!r}. "
                "Use a template that renders each message independently of the ones after it."
            )
        trailer = ""
        if end_of_turn and end_of_turn in before:
            trailer = before[before.rindex(end_of_turn) + len(end_of_turn) :]
        return self._ids(trailer + after[len(before) :])

    def _render(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
