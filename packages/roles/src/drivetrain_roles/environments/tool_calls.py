"""Reading tool calls out of a model turn: the Hermes/Qwen ``<tool_call>{json}</tool_call>`` format by default.

A parser turns the turn's text into calls and problems; a problem (a block that is not JSON, a call without a
``name``, an unclosed tag) is not raised but answered to the model as an observation, as peers do: a policy
learns to write calls only if it sees what was wrong with one.
"""

from __future__ import annotations

import contextlib
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, frozen=True)
class ParsedTurn:
    """What a parser found in one turn: the calls, in order, and one line per block it could not read."""

    calls: list[ToolCall]
    problems: list[str]

    @property
    def any(self) -> bool:
        """Whether the turn tried to call a tool at all (a call or a malformed one)."""
        return bool(self.calls or self.problems)


class ToolCallParser(ABC):
    """Reads tool calls from a model turn's text; subclass it for a model family with another format."""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The calls in ``text`` and what could not be read; never raises on the model's text."""


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as Qwen2.5/Qwen3 and Hermes models
    write them (and their chat templates render them)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        problems: list[str] = []
        blocks = re.findall(f"{re.escape(self.start)}(.*?){re.escape(self.end)}", text, flags=re.DOTALL)
        for block in blocks:
            call = _read_call(block.strip())
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                problems.append(call)
        if text.count(self.start) > len(blocks):
            problems.append(f"a {self.start} was not closed by {self.end}")
        return ParsedTurn(calls=calls, problems=problems)


def _read_call(block: str) -> ToolCall | str:
    """The call one block holds, or why it holds none."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError as e:
        return f"the tool call {block[:200]!r} is not JSON ({e.msg} at character {e.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return f'the tool call {block[:200]!r} has no "name"; write {{"name": ..., "arguments": {{...}}}}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return f"the arguments of the call to {value['name']!r} are not a JSON object"
    return ToolCall(name=value["name"], arguments=arguments)
