"""The Environment contract: sync and async hooks, checked answers, and plugins found by name.

An environment plugin is an entry point whose module implements ``register_environments`` (as the toy engine's
implements ``register_engines``); loaded through core's real plugin loading, it is listed with what it
registered and built by name, one fresh instance per episode; an unknown name lists what exists.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from drivetrain_engine_core._plugins import get_plugin_manager, reset_plugins
from drivetrain_engine_core.backend import ConfigError, PluginError, hookimpl
from drivetrain_engine_core.job import Environment, ModelTurn, StepResult, environment_factory, plugins
from drivetrain_engine_core.testing.plugins import InMemoryEntryPoint

TURN = ModelTurn(text="7", token_ids=(22,), turn=0)


class Countdown(Environment):
    """Counts down from the example's ``start``; a sync environment (its hooks run on a worker thread)."""

    def __init__(self, *, step: int = 1) -> None:
        self.step_size, self.left, self.threads = step, 0, set()

    def _reset(self, example):
        self.left = example["start"]
        self.threads.add(threading.current_thread().name)
        return [{"role": "user", "content": f"count down from {self.left}"}]

    def _step(self, turn):
        self.left -= self.step_size
        return StepResult(
            observation=[{"role": "user", "content": str(self.left)}], reward=1.0, done=self.left <= 0
        )


class AsyncCountdown(Countdown):
    async def _step(self, turn):
        await asyncio.sleep(0)
        return Countdown._step(self, turn)


@hookimpl
def register_environments(registry):
    registry.register("countdown", Countdown)
    registry.register("async-countdown", AsyncCountdown)


PLUGIN = SimpleNamespace(register_environments=register_environments)


@pytest.fixture
def countdown_plugin():
    entry_point = InMemoryEntryPoint(name="countdown", plugin=PLUGIN, distribution="drivetrain-countdown")
    reset_plugins()
    loaded = plugins(lambda: get_plugin_manager(entry_points=[entry_point], disabled=[]))
    yield loaded
    reset_plugins()


async def episode(environment: Environment, start: int) -> list[StepResult]:
    await environment.reset({"start": start})
    results = [await environment.step(TURN)]
    while not results[-1].done:
        results.append(await environment.step(TURN))
    await environment.close()
    return results


def test_an_environment_plugin_is_found_by_name_and_built_per_episode(countdown_plugin):
    assert countdown_plugin.environments.names() == ["async-countdown", "countdown"]
    (info,) = countdown_plugin.plugins
    assert (
        info.status == "loaded"
        and f"environment countdown -> {Countdown.__module__}:Countdown" in info.registered
    )
    build = environment_factory("countdown", {"step": 2})
    first, second = build(), build()
    assert first is not second and first.step_size == 2
    results = asyncio.run(episode(first, 5))
    assert [r.observation[0]["content"] for r in results] == ["3", "1", "-1"] and results[-1].done
    assert first.threads and threading.main_thread().name not in first.threads  # sync hooks ran off the loop


def test_an_unknown_environment_names_the_registered_ones(countdown_plugin):
    with pytest.raises(
        PluginError,
        match=r"no environment named 'countdwn'.*countdown \(drivetrain-countdown 0.1.0\).*Did you mean 'countdown'",
    ):
        environment_factory("countdwn")


def test_options_the_environment_does_not_take_are_named_before_any_episode(countdown_plugin):
    with pytest.raises(
        ConfigError,
        match=r"environment 'countdown' .* cannot be built with options \['stride'\].*takes \['step'\]",
    ):
        environment_factory("countdown", {"stride": 2})


def test_async_hooks_are_awaited_on_the_event_loop():
    results = asyncio.run(episode(AsyncCountdown(), 2))
    assert [r.reward for r in results] == [1.0, 1.0]


class Broken(Countdown):
    def __init__(self, reset_answer, step_answer):
        super().__init__()
        self.reset_answer, self.step_answer = reset_answer, step_answer

    def _reset(self, example):
        return self.reset_answer

    def _step(self, turn):
        return self.step_answer


@pytest.mark.parametrize(
    ("reset_answer", "step_answer", "message"),
    [
        ([], None, r"Broken._reset must be a non-empty list of chat messages"),
        ("hello", None, r"Broken._reset must be a non-empty list of chat messages"),
        ([{"content": "no role"}], None, r"Broken._reset holds .* which is not a chat message"),
        ([{"role": "user"}], ([], 1.0, True), r"Broken._step returned tuple; return a .*StepResult"),
        ([{"role": "user"}], StepResult(observation=["text"]), r"Broken._step's observation holds 'text'"),
    ],
)
def test_answers_outside_the_contract_name_the_environment_and_the_fix(reset_answer, step_answer, message):
    async def run():
        environment = Broken(reset_answer, step_answer)
        await environment.reset({})
        await environment.step(TURN)

    with pytest.raises(TypeError, match=message):
        asyncio.run(run())
