"""A Python function's tool schema: what chat templates render for ``tools=`` and models are trained on.

NOTE: transformers' ``get_json_schema`` rather than our own reader of signatures: it is what
``apply_chat_template(tools=[function])`` itself calls, so a tool shows the model exactly the schema it would
show in any Hugging Face chat (types from the annotations, descriptions from the Google-style docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drivetrain_engine_core.backend import ConfigError


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "description", "parameters"}}`` for ``function``.

    Raises:
        ConfigError: the function's docstring or annotations do not say what the schema needs (names the
            function and what to write).
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        name = getattr(function, "__qualname__", repr(function))
        raise ConfigError(
            f"tool {name}: its schema cannot be built ({e}). A tool needs a type annotation on every argument "
            "and a Google-style docstring: a one-line description, then 'Args:' with one 'name: description' "
            "line per argument."
        ) from e
