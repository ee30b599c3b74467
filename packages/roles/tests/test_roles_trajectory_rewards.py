"""A reward function reads a multi-turn episode: ``trajectory``, its messages (tool calls and observations) and
the environment's per-turn rewards, so a job adds a function reward on top of the environment's.

Two ``drivetrain grpo`` steps in the registered ``calculator`` environment (the ``calculator_grpo`` fixture),
every turn played by a scripted rollout (no sampling: each question's calls and answer are known here), the real
actor training on the episodes. The function writes down what it was given; each step's ``reward/tool_use``, ``train/reward`` and the
held-out ``val/reward/<name>`` are recomputed from the script's table.
"""

from __future__ import annotations

import json

import pytest
from drivetrain_roles.rl.reward_signatures import RewardError

PLAYS = {
    "1+2": (0, "3"),
    "4*5": (1, "20"),
    "6*7+8": (2, "49"),
    "9-3": (1, "7"),
    "7*8": (1, "56"),
    "2+2": (0, "5"),
}
"""Each question's tool calls before the answer, and the answer given (right for 1+2, 4*5, 7*8)."""
TRAIN, HELD_OUT = ["1+2", "4*5", "6*7+8", "9-3"], ["7*8", "2+2"]
CALL_COST = 0.3
WEIGHTS = {"tool_use": 1.0, "exact_match": 0.5}

FUNCTION = """
import json

def tool_use(trajectory, completions):
    values = []
    with open({log!r}, "a") as log:
        for episode, final in zip(trajectory, completions):
            calls = [c for m in episode.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
            log.write(json.dumps({{"messages": episode.messages, "turn_rewards": episode.turn_rewards,
                                   "final": final}}) + "\\n")
            values.append(sum(episode.turn_rewards) - {cost} * len(calls))
    return values
"""


def expected(expression: str) -> tuple[float, float, float]:
    """The environment's reward, ``tool_use`` and ``exact_match`` of a question's episode, from the table."""
    calls, answer = PLAYS[expression]
    right = float(answer == str(eval(expression)))  # the test's own arithmetic
    return right, right - CALL_COST * calls, right


def write_rows(path, expressions):
    rows = [
        {
            "prompt": f"What is {e}?",
            "response": str(eval(e)),
            "messages": [{"role": "user", "content": f"What is {e}?"}],
            "answer": str(eval(e)),
        }
        for e in expressions
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_reward_function_reads_each_episodes_tool_calls_and_turn_rewards(tmp_path, calculator_grpo):
    log = tmp_path / "seen.jsonl"
    (tmp_path / "rewards.py").write_text(FUNCTION.format(log=str(log), cost=CALL_COST))
    write_rows(tmp_path / "train.jsonl", TRAIN)
    write_rows(tmp_path / "val.jsonl", HELD_OUT)
    records = calculator_grpo(
        tmp_path,
        PLAYS,
        f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'val.jsonl'}]",
        f"algorithm.reward_functions=[{tmp_path / 'rewards.py'}:tool_use,exact_match]",
        f"algorithm.reward_weights=[{WEIGHTS['tool_use']},{WEIGHTS['exact_match']}]",
        "trainer.prompts_per_step=4",
    )

    # Every step plays each training question twice (4 prompts x 2): the means over the table.
    table = [expected(e) for e in TRAIN]
    steps = [r for r in records if "train/reward" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["reward/tool_use"] == pytest.approx(sum(t for _, t, _ in table) / 4, abs=1e-6)
        assert record["reward/exact_match"] == pytest.approx(0.5, abs=1e-6)
        # The function's reward on top of the environment's, weighted.
        totals = [env + WEIGHTS["tool_use"] * t + WEIGHTS["exact_match"] * m for env, t, m in table]
        assert record["train/reward"] == pytest.approx(sum(totals) / 4, abs=1e-6)
    # Held out: one greedy episode per question, before the first step and after the last.
    evaluations = [r for r in records if "val/reward" in r]
    held_out = [expected(e) for e in HELD_OUT]
    assert len(evaluations) == 2
    for record in evaluations:
        assert record["val/reward/tool_use"] == pytest.approx(sum(t for _, t, _ in held_out) / 2, abs=1e-6)
        assert record["val/reward/exact_match"] == pytest.approx(0.5, abs=1e-6)
        totals = [env + WEIGHTS["tool_use"] * t + WEIGHTS["exact_match"] * m for env, t, m in held_out]
        assert record["val/reward"] == pytest.approx(sum(totals) / 2, abs=1e-6)

    # What the function was given for the two-call episode: the conversation with its calls and results.
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    two_calls = next(s for s in seen if s["messages"][0]["content"] == "What is 6*7+8?")
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7+8"}}}
    assert [m["role"] for m in two_calls["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert two_calls["messages"][1]["tool_calls"] == two_calls["messages"][3]["tool_calls"] == [call]
    assert two_calls["messages"][2] == {"role": "tool", "name": "calculator", "content": "50"}
    assert two_calls["messages"][-1] == {"role": "assistant", "content": "49"} and two_calls["final"] == "49"
    assert two_calls["turn_rewards"] == [0.0, 0.0, 0.0]


def test_a_single_turn_job_refuses_a_function_that_needs_the_trajectory(
    tmp_path, arithmetic_prompts, tool_tokenizer
):
    from drivetrain_roles.rl.reward_settings import RewardSettings
    from drivetrain_roles.rl.rewards import check_reward_inputs

    (tmp_path / "turns.py").write_text(
        "def turns(trajectory):\n    return [t.num_turns for t in trajectory]\n"
    )
    settings = RewardSettings.single(f"{tmp_path / 'turns.py'}:turns")
    examples = arithmetic_prompts(tool_tokenizer, 2)
    with pytest.raises(RewardError, match=r"asks for \['trajectory'\].*set environment\.name"):
        check_reward_inputs(settings, examples)
    check_reward_inputs(settings, examples, episodes=True)
