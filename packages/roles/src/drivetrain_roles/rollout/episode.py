"""One multi-turn episode while it runs: its environment, its growing token sequence, why it stopped.

The loop (:mod:`.multi_turn`) owns the order of things; an episode only records: a model turn's sampled ids and
log-probs as they came, the rendered ids of what the environment answered (loss mask 0), each turn's reward, and
the same conversation as chat messages (what a reward function reads as ``trajectory``): the model's turns as
``assistant`` messages with the calls its environment reads in them (:class:`ReadsToolCalls`), and each
observation the model was shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from drivetrain_engine_core.backend import EngineStateError
from drivetrain_engine_core.job import Environment, Message, ModelTurn, StepResult

from .chat_rendering import ChatRenderer
from .trajectory import Trajectory

PENDING = -1
"""The version of context tokens until the turn that reads them first is sampled."""


@runtime_checkable
class ReadsToolCalls(Protocol):
    """An environment that reads tool calls in a model turn (:class:`~drivetrain_roles.environments.
    ToolEnvironment`): its calls go into the turn's ``assistant`` message as ``tool_calls``."""

    def tool_calls(self, text: str) -> list[Message]:
        """The calls in a turn's ``text``, as chat templates take them (``{"type": "function", "function":
        {"name": ..., "arguments": {...}}}``); empty when it holds none."""
        ...


@dataclass
class Episode:
    """The state of one episode; ``stop_reason`` is ``None`` while it runs."""

    environment: Environment
    example: Mapping[str, Any]
    renderer: ChatRenderer | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[Mapping[str, Any]] = field(default_factory=list)
    prompt_length: int = 0
    end_of_turn: str | None = None
    """The text of the token that ended the last model turn (what the chat template writes after it follows)."""
    stop_reason: str | None = None
    messages: list[Message] = field(default_factory=list)
    """The episode as chat messages (see the module docstring)."""

    @property
    def running(self) -> bool:
        return self.stop_reason is None

    async def start(self, tokenizer: Any, max_total_tokens: int) -> None:
        """Reset the environment and lay down the first prompt (the episode stops at once if it fills the
        token limit)."""
        messages = await self.environment.reset(self.example)
        self.messages = list(messages)
        self.renderer = ChatRenderer(tokenizer, self.environment.tool_schemas())
        self.add_context(self.renderer.prompt_ids(messages))
        self.prompt_length = len(self.ids)
        if self.prompt_length >= max_total_tokens:
            self.stop("max_total_tokens")

    def add_context(self, ids: Sequence[int]) -> None:
        """Append tokens the model did not sample (the prompt, an observation): loss mask 0."""
        self.ids += ids
        self.mask += [False] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [PENDING] * len(ids)

    def add_observation(self, observation: Sequence[Message], max_total_tokens: int) -> None:
        """Append what the environment answered, rendered after the last turn; the episode stops instead when
        it would leave no room for one more model token."""
        delta = self._renderer("add_observation").delta_ids(observation, self.end_of_turn)
        if len(self.ids) + len(delta) >= max_total_tokens:
            self.stop("max_total_tokens")
        else:
            self.add_context(delta)
            self.messages += observation

    def add_turn(self, ids: Sequence[int], log_probs: Sequence[float], version: int) -> None:
        """Append a model turn as sampled, and its ``assistant`` message (decoded without special tokens, as the
        environment reads it); the context before it gets its version."""
        self.versions = [version if v == PENDING else v for v in self.versions]
        self.spans.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.mask += [True] * len(ids)
        self.log_probs += log_probs
        self.versions += [version] * len(ids)
        self.rewards.append(0.0)
        text = self._renderer("add_turn").tokenizer.decode(ids, skip_special_tokens=True)
        message: Message = {"role": "assistant", "content": text}
        calls = self.environment.tool_calls(text) if isinstance(self.environment, ReadsToolCalls) else []
        self.messages.append(message | ({"tool_calls": calls} if calls else {}))

    def model_turn(self, tokenizer: Any) -> ModelTurn:
        """The last model turn as the environment reads it."""
        start, stop = self.spans[-1]
        ids = tuple(self.ids[start:stop])
        return ModelTurn(
            text=tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids, turn=len(self.spans) - 1
        )

    def _renderer(self, method: str) -> ChatRenderer:
        if self.renderer is None:
            raise EngineStateError(f"Episode.{method}() before start(): the episode has no chat renderer.")
        return self.renderer

    def record(self, result: StepResult) -> None:
        """Keep the environment's answer to the last turn: its reward and info."""
        self.rewards[-1] = float(result.reward)
        self.infos.append(dict(result.info))

    def stop(self, reason: str, info: Mapping[str, Any] | None = None) -> None:
        self.stop_reason = reason
        if info:
            self.infos.append(dict(info))

    def trajectory(self, final_version: int) -> Trajectory:
        """The finished episode; context no turn read carries ``final_version``."""
        return Trajectory(
            input_ids=torch.tensor(self.ids, dtype=torch.long),
            loss_mask=torch.tensor(self.mask, dtype=torch.bool),
            log_probs=torch.tensor(self.log_probs, dtype=torch.float32),
            versions=torch.tensor(
                [final_version if v == PENDING else v for v in self.versions], dtype=torch.long
            ),
            turn_spans=tuple(self.spans),
            turn_rewards=tuple(self.rewards),
            prompt_length=self.prompt_length,
            stop_reason=self.stop_reason or "max_turns",
            infos=tuple(self.infos),
            messages=tuple(self.messages),
        )
