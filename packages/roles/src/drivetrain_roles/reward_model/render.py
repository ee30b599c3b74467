"""The conversation a reward model scores, written with its own tokenizer and chat template.

The policy's tokens are not the reward model's: the two may have other tokenizers and templates. As verl does
when their tokenizers differ (its reward-model worker's ``_switch_chat_template``), the conversation is
rendered again for the reward model: the prompt's messages (the ``data.messages_key`` conversation without its
reference turn, or the prompt as one user turn under ``data.apply_chat_template``) and the decoded completion
as the assistant's turn, through the reward model's chat template. A plain-text prompt (neither option) is
``tokenizer(prompt)`` followed by the completion's tokens, as ``drivetrain rm`` builds a plain prompt/response
pair. Trailing padding tokens are left off: a Hugging Face sequence-classification model reads its score at
the last token that is not its ``pad_token_id``.

In a multi-turn job (``environment.name``) the reward model scores the whole episode, not its last turn: the
episode's chat messages (``Trajectory.messages``: the first prompt, each model turn as an ``assistant`` message
with its ``tool_calls``, each observation such as a ``tool`` message) through the reward model's template, which
renders tool calls and results its own way. The tool schemas the policy was shown are not: the reward model
judges the conversation, as verl's reward model is shown the prompt and the response alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..jobs.data import DataError, prompt_token_ids, template_ids

Message = dict[str, Any]


class PromptColumns(Protocol):
    """The ``data`` options that say where a row's prompt is and how it was rendered."""

    @property
    def prompt_key(self) -> str: ...
    @property
    def response_key(self) -> str | None: ...
    @property
    def messages_key(self) -> str | None: ...
    @property
    def apply_chat_template(self) -> bool: ...


def prompt_messages(columns: Mapping[str, Any], data: PromptColumns) -> list[Message] | None:
    """The prompt of a row as chat messages, or ``None`` for a plain-text prompt."""
    if data.messages_key is not None:
        messages = list(columns[data.messages_key])
        return messages if data.response_key is None else messages[:-1]
    if data.apply_chat_template:
        return [{"role": "user", "content": str(columns[data.prompt_key])}]
    return None


def scored_ids(
    tokenizer: Any,
    prompt: str,
    messages: Sequence[Message] | None,
    completion: str,
    *,
    pad_token_id: int | None,
) -> list[int]:
    """The reward model's tokens of a prompt (``messages``, else the text ``prompt``) and its completion.

    Raises:
        DataError: chat messages and a tokenizer without a chat template, or a prompt with characters the
            tokenizer does not know.
    """
    if messages is None:
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        ids = prompt_token_ids(prompt, tokenizer, "the reward model's prompt") + list(completion_ids)
        return _unpadded(ids, pad_token_id)
    conversation = [*messages, {"role": "assistant", "content": completion}]
    return chat_ids(tokenizer, conversation, pad_token_id=pad_token_id)


def chat_ids(tokenizer: Any, conversation: Sequence[Message], *, pad_token_id: int | None) -> list[int]:
    """The reward model's tokens of a whole conversation (a prompt and its answer, or a multi-turn episode's
    messages) under its chat template, without a generation prompt.

    Raises:
        DataError: a tokenizer without a chat template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the conversations are chat messages (chat prompts, or a multi-turn job's episodes), but the reward "
            "model's tokenizer has no chat template to render them with; give the reward model's folder one "
            "(tokenizer_config.json chat_template) or use a reward model trained on chats."
        )
    return _unpadded(template_ids(tokenizer, list(conversation), add_generation_prompt=False), pad_token_id)


def _unpadded(ids: list[int], pad_token_id: int | None) -> list[int]:
    """``ids`` without trailing ``pad_token_id`` tokens (at least one token kept)."""
    while pad_token_id is not None and len(ids) > 1 and ids[-1] == pad_token_id:
        ids.pop()
    return ids
