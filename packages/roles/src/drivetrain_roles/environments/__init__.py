"""Environments that multi-turn rollouts act in: Python functions as tools, and any environment served over
HTTP (the contract is :class:`drivetrain_engine_core.job.Environment`)."""

from .http import EnvironmentServerError, HTTPEnvironment
from .tool_calls import HermesToolCallParser, ParsedTurn, ToolCall, ToolCallParser
from .tool_schemas import tool_schema
from .tools import RewardFunction, ToolEnvironment

__all__ = [
    "EnvironmentServerError",
    "HTTPEnvironment",
    "HermesToolCallParser",
    "ParsedTurn",
    "RewardFunction",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "tool_schema",
]
