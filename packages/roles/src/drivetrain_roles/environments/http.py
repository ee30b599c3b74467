"""``HTTPEnvironment``: an environment served over HTTP (OpenEnv-style ``POST /reset``, ``POST /step``, JSON).

The wire format by default, one session per episode:

- ``POST {url}/reset`` with ``{"example": <row>}`` answers ``{"observation": [messages], "episode_id": ...,
  "tools": [schemas]}`` (``episode_id`` and ``tools`` optional);
- ``POST {url}/step`` with ``{"episode_id": ..., "turn": {"text": ..., "token_ids": [...], "turn": k}}``
  answers ``{"observation": [messages], "reward": float, "done": bool, "info": {...}}``.

A server that speaks another JSON (OpenEnv's ``{"action": ...}`` and its own observation objects) is adapted
by overriding :meth:`HTTPEnvironment.reset_payload`, :meth:`step_payload` and :meth:`messages`, a few lines each.
Requests run on the standard library (no client to install), each within ``timeout_s``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from drivetrain_engine_core.backend import DrivetrainError
from drivetrain_engine_core.job import Environment, Message, ModelTurn, StepResult


class EnvironmentServerError(DrivetrainError, RuntimeError):
    """An environment server could not be reached or answered something else than the wire format."""


class HTTPEnvironment(Environment):
    """One episode of an environment served at ``url``.

    Args:
        url: the server's base address (``http://host:port``); ``/reset`` and ``/step`` are appended.
        timeout_s: how long one request may take.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._episode: Any = None
        self._tools: list[dict[str, Any]] = []

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self._tools)

    def reset_payload(self, example: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON body of ``/reset`` for ``example``."""
        return {"example": dict(example)}

    def step_payload(self, turn: ModelTurn) -> dict[str, Any]:
        """The JSON body of ``/step`` for the model's ``turn``."""
        turn_json = {"text": turn.text, "token_ids": list(turn.token_ids), "turn": turn.turn}
        return {"episode_id": self._episode, "turn": turn_json}

    def messages(self, answer: Mapping[str, Any]) -> list[Message]:
        """The chat messages an answer of ``/reset`` or ``/step`` holds (its ``observation``)."""
        return list(answer.get("observation") or [])

    def _reset(self, example: Mapping[str, Any]) -> list[Message]:
        answer = self._post("reset", self.reset_payload(example))
        self._episode = answer.get("episode_id")
        self._tools = list(answer.get("tools") or [])
        return self.messages(answer)

    def _step(self, turn: ModelTurn) -> StepResult:
        answer = self._post("step", self.step_payload(turn))
        return StepResult(
            observation=self.messages(answer),
            reward=float(answer.get("reward") or 0.0),
            done=bool(answer.get("done", False)),
            info=dict(answer.get("info") or {}),
        )

    def _post(self, route: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``payload`` as JSON to ``{url}/{route}``; the decoded JSON object answered.

        Raises:
            EnvironmentServerError: the server is unreachable, answers an HTTP error, or no JSON object.
        """
        address = f"{self.url}/{route}"
        request = urllib.request.Request(
            address, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:500]
            raise EnvironmentServerError(f"POST {address} answered HTTP {e.code}: {body}") from e
        except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, bad JSON
            raise EnvironmentServerError(
                f"POST {address} failed ({e}); check that the environment server runs at {self.url} and "
                f"answers JSON within {self.timeout_s:g} s."
            ) from e
        if not isinstance(answer, dict):
            raise EnvironmentServerError(f"POST {address} answered {answer!r:.200}, not a JSON object.")
        return answer
