"""Environments in multi-turn rollouts: tools that fail become observations, hung steps are cut, HTTP works.

A scripted rollout (the Rollout contract, answering from the conversation so far) writes the model's turns, so
each case is exact: a malformed call, a raising tool and a hanging tool each come back to the model as a
``tool`` message rendered by a tool-aware chat template; a hung environment step ends only its episode at its
timeout; and a toy game served by a local ``http.server`` plays through the registered ``http`` environment.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import Environment, StepResult, environment_factory
from drivetrain_engine_core.rollout import SamplingConfig
from drivetrain_engine_core.testing.tokenizer import IM_END
from drivetrain_roles.environments import (
    EnvironmentServerError,
    HermesToolCallParser,
    HTTPEnvironment,
    ToolCall,
    ToolEnvironment,
)
from drivetrain_roles.rollout.multi_turn import run_episodes
from drivetrain_roles.rollout.turn_limits import TurnLimits


@pytest.fixture(scope="module")
def tokenizer(tool_tokenizer):
    return tool_tokenizer


def sampling(tokenizer, n=1):
    return SamplingConfig(n=n, max_new_tokens=200, stop_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def explode() -> str:
    """Fail, always."""
    raise ValueError("boom")


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "woke"


CALLS = {
    "malformed": '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
    "raising": '<tool_call>{"name": "explode", "arguments": {}}</tool_call>',
    "hanging": '<tool_call>{"name": "hang", "arguments": {"seconds": 60}}</tool_call>',
    "good": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
}
OBSERVED = {
    "malformed": 'Error: the tool call \'{"name": "add", "arguments": {"a": 1,}}\' is not JSON',
    "raising": "Error: the tool 'explode' raised ValueError: boom",
    "hanging": "Error: the tool 'hang' did not answer within 1 s.",
    "good": "<tool_response>\n5\n</tool_response>",
}


def tool_script(context: str) -> str:
    """First turn: the case's call (named in the user's question); second: the answer the tool gave, if any."""
    if "<tool_response>" not in context:
        return CALLS[re.search(r"case (\w+)", context).group(1)]
    return "it is 5" if "<tool_response>\n5\n" in context else "no idea"


def test_malformed_raising_and_hanging_tool_calls_become_observations(tokenizer, scripted_rollout):
    rollout = scripted_rollout(tokenizer, tool_script)
    examples = [{"prompt": f"case {case}: what is 2 + 3?", "answer": "5"} for case in CALLS]
    started = time.perf_counter()
    trajectories = run_episodes(
        rollout,
        tokenizer,
        lambda: ToolEnvironment(
            [add, explode, hang], reward=lambda ex, text: float(ex["answer"] in text), tool_timeout_s=1.0
        ),
        examples,
        sampling(tokenizer),
    )
    elapsed = time.perf_counter() - started
    assert (
        elapsed < 1.0 + 1.0
    )  # the hanging tool was cut at its timeout, and the other episodes waited no longer
    for case, trajectory in zip(CALLS, trajectories, strict=True):
        text = tokenizer.decode(trajectory.input_ids)
        assert trajectory.stop_reason == "done" and trajectory.num_turns == 2, case
        assert OBSERVED[case] in text, (case, text)
        (_, first_end), (second_start, _) = trajectory.turn_spans
        observation = trajectory.input_ids[first_end:second_start]
        assert not trajectory.loss_mask[first_end:second_start].any()  # the observation is not trained on
        assert tokenizer.decode(observation).startswith("\n<|im_start|>user\n<tool_response>\n")
        assert trajectory.infos[0]["tool_errors"] == (case != "good")
        assert trajectory.turn_rewards == (0.0, float(case == "good"))
    # The tools were shown to the model: the first prompt lists their schemas.
    assert '"name": "hang"' in tokenizer.decode(trajectories[0].input_ids[: trajectories[0].prompt_length])


class HangingEnvironment(Environment):
    def _reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def _step(self, turn):
        time.sleep(30)
        return StepResult(done=True)


class AsyncHangingEnvironment(HangingEnvironment):
    async def _step(self, turn):
        await asyncio.sleep(30)
        return StepResult(done=True)


class FailingEnvironment(HangingEnvironment):
    def _step(self, turn):
        raise ConnectionError("the sandbox is gone")


def test_a_hung_or_failing_environment_step_ends_only_its_episode(tokenizer, scripted_rollout):
    built = iter([HangingEnvironment(), AsyncHangingEnvironment(), FailingEnvironment()])
    started = time.perf_counter()
    trajectories = run_episodes(
        scripted_rollout(tokenizer, lambda context: "hello"),
        tokenizer,
        lambda: next(built),
        [{"prompt": "the answer is"}] * 3,
        sampling(tokenizer),
        TurnLimits(step_timeout_s=0.5),
    )
    assert time.perf_counter() - started < 0.5 + 1.0
    assert [t.stop_reason for t in trajectories] == ["step_timeout", "step_timeout", "step_error"]
    assert trajectories[2].infos[-1] == {"error": "ConnectionError: the sandbox is gone"}
    assert all(t.num_turns == 1 and t.turn_rewards == (0.0,) for t in trajectories)


class HangingReset(HangingEnvironment):
    def _reset(self, example):
        time.sleep(30)


def test_a_hung_reset_is_an_error_naming_the_environment(tokenizer, scripted_rollout):
    started = time.perf_counter()
    with pytest.raises(
        TimeoutError, match=r"environment HangingReset: reset\(\) took longer than step_timeout_s=0.3 s"
    ):
        run_episodes(
            scripted_rollout(tokenizer, lambda context: "hello"),
            tokenizer,
            HangingReset,
            [{"prompt": "the answer is"}],
            sampling(tokenizer),
            TurnLimits(step_timeout_s=0.3),
        )
    assert time.perf_counter() - started < 0.3 + 1.0


class GuessingGame(BaseHTTPRequestHandler):
    """A number-guessing game served over HTTP: ``/reset`` deals a secret, ``/step`` answers higher/lower."""

    sessions: ClassVar[dict[int, dict]] = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/reset":
            episode = len(self.sessions)
            self.sessions[episode] = {"secret": body["example"]["secret"], "turns": []}
            answer = {
                "episode_id": episode,
                "observation": [{"role": "user", "content": "Guess from 1 to 9."}],
            }
        else:
            session = self.sessions[body["episode_id"]]
            session["turns"].append(body["turn"]["token_ids"])
            guess = int(re.search(r"\d", body["turn"]["text"]).group())
            hint = "higher" if guess < session["secret"] else "lower"
            won = guess == session["secret"]
            answer = {"observation": [{"role": "user", "content": hint}], "reward": float(won), "done": won}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture
def game_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), GuessingGame)
    GuessingGame.sessions = {}
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_environment_served_over_http_plays_through_the_registered_adapter(
    tokenizer, game_url, scripted_rollout
):
    guesses = ["3", "5", "7"]
    rollout = scripted_rollout(
        tokenizer, lambda context: f"I guess {guesses[context.count('assistant') - 1]}"
    )
    trajectories = run_episodes(
        rollout,
        tokenizer,
        environment_factory("http", {"url": game_url}),
        [{"secret": 5}, {"secret": 7}],
        sampling(tokenizer),
        TurnLimits(max_turns=3),
    )
    assert [t.num_turns for t in trajectories] == [2, 3]
    assert [t.turn_rewards for t in trajectories] == [(0.0, 1.0), (0.0, 0.0, 1.0)]
    assert [t.stop_reason for t in trajectories] == ["done", "done"]
    assert "<|im_start|>user\nhigher<|im_end|>" in tokenizer.decode(trajectories[1].input_ids)
    # The server received each turn's ids exactly as the trajectory holds them.
    received = sorted(GuessingGame.sessions.values(), key=lambda s: s["secret"])
    for session, trajectory in zip(received, trajectories, strict=True):
        assert session["turns"] == [turn.tolist() for turn in trajectory.model_turns()]


def test_an_unreachable_environment_server_is_named():
    environment = HTTPEnvironment("http://127.0.0.1:9", timeout_s=2.0)
    with pytest.raises(
        EnvironmentServerError, match=r"POST http://127.0.0.1:9/reset failed .*environment server runs"
    ):
        asyncio.run(environment.reset({"prompt": "hello"}))


@pytest.mark.parametrize(
    ("text", "calls", "problems"),
    [
        ("no call, just the answer 5", [], []),
        (
            'a <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>',
            [
                ToolCall(name="add", arguments={"a": 1, "b": 2}),
                ToolCall(name="add", arguments={"a": 3, "b": 4}),
            ],
            [],
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', [], ['has no "name"']),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', [], ["are not a JSON object"]),
        ('<tool_call>{"name": "add", "arguments": {}}', [], ["was not closed by </tool_call>"]),
    ],
)
def test_the_hermes_parser_reads_calls_and_names_what_it_cannot(text, calls, problems):
    parsed = HermesToolCallParser().parse(text)
    assert parsed.calls == calls
    assert len(parsed.problems) == len(problems)
    assert all(p in found for p, found in zip(problems, parsed.problems, strict=True))


def test_a_tool_without_a_docstring_is_refused_with_the_fix():
    def mystery(x):
        return x

    with pytest.raises(
        ConfigError, match=r"tool .*mystery: its schema cannot be built .* Google-style docstring"
    ):
        ToolEnvironment([mystery])
