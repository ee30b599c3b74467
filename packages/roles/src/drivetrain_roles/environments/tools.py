"""``ToolEnvironment``: stateless Python functions as tools, the shortest way to an agentic task.

Each model turn is read by a :class:`~.tool_calls.ToolCallParser`; every call runs on its own daemon thread
within ``tool_timeout_s``, and its result (or what went wrong: an unknown tool, bad arguments, an exception,
a timeout, a call that did not parse) goes back to the model as a ``tool`` message. A turn without a call is
the model's answer: the episode ends there, with ``reward(example, answer)`` as the final reward.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import Environment, Message, ModelTurn, StepResult

from .tool_calls import HermesToolCallParser, ToolCall, ToolCallParser
from .tool_schemas import tool_schema

RewardFunction = Callable[[Mapping[str, Any], str], float]
"""``reward(example, answer)``: the final reward of an episode from its data set row and the model's answer."""


class ToolEnvironment(Environment):
    """An episode of one conversation in which the model may call ``tools``.

    Args:
        tools: plain functions with annotated arguments and a Google-style docstring (their schema is built
            by :func:`~.tool_schemas.tool_schema`); they keep no state between calls.
        reward: the final reward of an answer (``None``: 0).
        parser: how calls are read from a turn (default: Hermes/Qwen ``<tool_call>`` blocks).
        tool_timeout_s: how long one call may run before the model is told it timed out.
        max_result_chars: a longer result is cut to this many characters (the context is finite).
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        reward: RewardFunction | None = None,
        parser: ToolCallParser | None = None,
        tool_timeout_s: float = 10.0,
        max_result_chars: int = 2000,
    ) -> None:
        if tool_timeout_s <= 0 or max_result_chars < 1:
            raise ConfigError(
                f"ToolEnvironment needs tool_timeout_s > 0 and max_result_chars >= 1, got {tool_timeout_s}, "
                f"{max_result_chars}."
            )
        self._schemas = [tool_schema(tool) for tool in tools]
        names = [schema["function"]["name"] for schema in self._schemas]
        if len(set(names)) < len(names):
            raise ConfigError(
                f"ToolEnvironment: several tools are named {sorted({n for n in names if names.count(n) > 1})}; "
                "the model calls a tool by its function's name, so give each a name of its own."
            )
        self._tools = {
            schema["function"]["name"]: tool for schema, tool in zip(self._schemas, tools, strict=True)
        }
        self._reward = reward
        self._parser = parser or HermesToolCallParser()
        self._timeout = tool_timeout_s
        self._max_chars = max_result_chars
        self._example: Mapping[str, Any] = {}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self._schemas)

    def tool_calls(self, text: str) -> list[Message]:
        """The calls the parser reads in a turn's ``text``, as chat templates take them (``{"type": "function",
        "function": {"name": ..., "arguments": {...}}}``): what the trajectory's ``assistant`` message holds."""
        return [
            {"type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}
            for call in self._parser.parse(text).calls
        ]

    def _reset(self, example: Mapping[str, Any]) -> list[Message]:
        self._example = example
        if isinstance(example.get("messages"), list):
            return list(example["messages"])
        if isinstance(example.get("prompt"), str):
            return [{"role": "user", "content": example["prompt"]}]
        raise ConfigError(
            f"ToolEnvironment: the example has neither 'messages' (a conversation) nor 'prompt' (a string); its "
            f"keys are {sorted(example)}. Give the data set one of those columns."
        )

    def _step(self, turn: ModelTurn) -> StepResult:
        parsed = self._parser.parse(turn.text)
        if not parsed.any:
            reward = 0.0 if self._reward is None else float(self._reward(self._example, turn.text))
            return StepResult(reward=reward, done=True)
        answers = [self._run(call) for call in parsed.calls]
        errors = [f"Error: {problem}." for problem in parsed.problems]
        observation = [self._message(text, name) for name, text in answers]
        observation += [self._message(text, None) for text in errors]
        failed = len(errors) + sum(text.startswith("Error:") for _, text in answers)
        return StepResult(observation=observation, info={"tool_calls": len(answers), "tool_errors": failed})

    def _message(self, text: str, name: str | None) -> Message:
        if len(text) > self._max_chars:
            text = text[: self._max_chars] + " [cut]"
        return {"role": "tool", "content": text} | ({"name": name} if name else {})

    def _run(self, call: ToolCall) -> tuple[str, str]:
        """``(tool name, result text)`` of one call; every failure is a text starting ``Error:``."""
        tool = self._tools.get(call.name)
        if tool is None:
            return (
                call.name,
                f"Error: there is no tool named {call.name!r}; the tools are {sorted(self._tools)}.",
            )
        done: dict[str, Any] = {}

        def work() -> None:
            try:
                done["result"] = tool(**call.arguments)
            except BaseException as e:
                done["error"] = e

        # NOTE: a daemon thread, given up on at the timeout: Python cannot stop a thread, but an abandoned
        # daemon thread neither blocks the episode nor keeps the process alive.
        worker = threading.Thread(target=work, name=f"drivetrain-tool-{call.name}", daemon=True)
        worker.start()
        worker.join(self._timeout)
        if worker.is_alive():
            return call.name, f"Error: the tool {call.name!r} did not answer within {self._timeout:g} s."
        if "error" in done:
            error = done["error"]
            return call.name, f"Error: the tool {call.name!r} raised {type(error).__name__}: {error}"
        return call.name, _as_text(done["result"])


def _as_text(result: Any) -> str:
    """A tool result as the model reads it: strings as they are, anything else as JSON when it can be."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)
