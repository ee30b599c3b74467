"""The ``Environment`` contract: what a multi-turn rollout acts in (a tool box, a game, a sandbox, a service).

An episode is ``reset(example)`` (the conversation the model starts from), then, after each model turn,
``step(turn)`` (what the model sees next, the turn's reward, whether the episode is over). Observations are chat
messages, not text or token ids: the rollout renders them with the model's own chat template and appends their
tokens to the one token sequence of the trajectory, so an environment never needs the tokenizer and the model's
sampled tokens are never re-tokenised. The turn carries both the decoded text (what tool-call parsers read) and
the sampled ids.

Environments are plugins (``register_environments``) and stateful: a rollout builds one instance per episode
(:func:`environment_factory`). Hooks may be plain functions or coroutines; the public methods are coroutines
either way, and a plain hook runs on a daemon thread, so a slow environment holds up neither the others nor the
process at exit (a hook that never returns is abandoned when the rollout's timeout cuts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._config import ConfigError

Message = dict[str, Any]
"""One chat message as chat templates take it: ``{"role": ..., "content": ...}`` plus template-specific keys
(``name``, ``tool_calls``, ``tool_call_id``)."""

T = TypeVar("T")


@dataclass(kw_only=True, frozen=True)
class ModelTurn:
    """One model turn as it was sampled.

    Attributes:
        text: the decoded turn, special tokens removed (what a tool-call parser reads).
        token_ids: the sampled ids, the end-of-turn token included when one was sampled.
        turn: which turn of the episode it is (0: the first).
    """

    text: str
    token_ids: tuple[int, ...]
    turn: int


@dataclass(kw_only=True, frozen=True)
class StepResult:
    """What an environment answers to a model turn.

    Attributes:
        observation: messages appended to the conversation after the turn (tool results as ``tool`` messages,
            a game's next state as a ``user`` message); empty when there is nothing to add. Not shown to the
            model when ``done``.
        reward: the reward of this turn (an episode's rewards are each turn's, see the trajectory format).
        done: whether the episode is over.
        info: anything else worth keeping with the trajectory (plain values).
    """

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """A multi-turn environment: one instance per episode.

    Subclasses implement ``_reset`` and ``_step`` (plain or ``async def``), and may override
    :meth:`tool_schemas` (the JSON schemas of the tools the chat template shows the model) and ``_close``.
    The public methods check what the hooks return, so a mistake names the environment and the fix.
    """

    async def reset(self, example: Mapping[str, Any]) -> list[Message]:
        """Start an episode from ``example`` (a data set row); returns the conversation the model answers first.

        Raises:
            TypeError: the hook returned no list of messages, or an empty one.
        """
        messages = await call_hook(self._reset, example)
        check_messages(messages, f"{type(self).__name__}._reset", allow_empty=False)
        return list(messages)

    async def step(self, turn: ModelTurn) -> StepResult:
        """The environment's answer to the model's ``turn``.

        Raises:
            TypeError: the hook returned no :class:`StepResult`, or its observation holds no messages.
        """
        result = await call_hook(self._step, turn)
        if not isinstance(result, StepResult):
            raise TypeError(
                f"{type(self).__name__}._step returned {type(result).__name__}; return a "
                "drivetrain_engine_core.job.StepResult(observation=[...], reward=..., done=...)."
            )
        check_messages(result.observation, f"{type(self).__name__}._step's observation", allow_empty=True)
        return result

    async def close(self) -> None:
        """Release what the episode holds (a sandbox, a remote session); called once the episode ends."""
        await call_hook(self._close)

    def tool_schemas(self) -> list[dict[str, Any]]:
        """JSON schemas of the tools the model may call (the chat template's ``tools=``), read after
        :meth:`reset`; none by default."""
        return []

    @abstractmethod
    def _reset(self, example: Mapping[str, Any]) -> list[Message] | Awaitable[list[Message]]:
        """The first conversation of an episode (at least one message)."""

    @abstractmethod
    def _step(self, turn: ModelTurn) -> StepResult | Awaitable[StepResult]:
        """The answer to one model turn."""

    def _close(self) -> None:  # noqa: B027 - most environments hold nothing to release
        """Release the episode's resources; nothing by default."""


def check_messages(messages: Any, what: str, *, allow_empty: bool) -> None:
    """Refuse what is not a list of chat messages (dicts with a string ``role``), naming ``what``.

    Raises:
        TypeError: not a list of messages, or empty where ``allow_empty`` is false.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or (not messages and not allow_empty):
        raise TypeError(
            f"{what} must be a non-empty list of chat messages such as "
            f"[{{'role': 'user', 'content': '...'}}], got {messages!r:.200}."
        )
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TypeError(
                f"{what} holds {message!r:.200}, which is not a chat message; each is a dict with a 'role' "
                "('user', 'tool', ...) and a 'content'."
            )


async def call_hook(hook: Callable[..., T | Awaitable[T]], *args: Any) -> T:
    """Await ``hook(*args)``: a coroutine function directly, a plain function on a daemon thread.

    NOTE: a daemon thread rather than ``asyncio.to_thread``: the event loop's default executor is joined when
    ``asyncio.run`` returns, so one hook that never returns would hang the process after its timeout fired.
    """
    if inspect.iscoroutinefunction(hook):
        return await hook(*args)
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled by a timeout meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (hook(*args), None)
        except BaseException as error:
            outcome = (None, error)
        # the loop is closed when nobody waits for this answer any more
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(
        target=work, name=f"drivetrain-env-{getattr(hook, '__name__', 'hook')}", daemon=True
    ).start()
    result = await future
    if inspect.isawaitable(result):  # a plain function that returned an awaitable
        return await result
    return result


def environment_factory(name: str, options: Mapping[str, Any] | None = None) -> Callable[[], Environment]:
    """A function that builds a fresh environment registered under ``name`` (with ``options`` as keyword
    arguments) for each episode; the name and the options are checked now, so a typo fails before any sampling.

    Raises:
        PluginError: no environment of that name (the message lists the registered ones and the install
            command).
        ConfigError: ``options`` the environment's constructor does not take (names them and what it takes).
    """
    from ._plugins import plugins

    cls: type[Environment] = plugins().environments.get(name)
    values = dict(options or {})
    signature = inspect.signature(cls)
    try:
        signature.bind(**values)
    except TypeError as e:
        raise ConfigError(
            f"environment {name!r} ({cls.__module__}.{cls.__qualname__}) cannot be built with options "
            f"{sorted(values)}: {e}. It takes {list(signature.parameters) or 'no options'}."
        ) from e
    return lambda: cls(**values)


__all__ = [
    "Environment",
    "Message",
    "ModelTurn",
    "StepResult",
    "call_hook",
    "check_messages",
    "environment_factory",
]
