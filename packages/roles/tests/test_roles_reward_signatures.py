"""Reward functions are checked against drivetrain's call when they load; verl's and TRL's shapes are taken as they
are. Each peer's function below is written as its documentation shows it; the rewards are the numbers each
function's formula gives, computed here by hand."""

from __future__ import annotations

import pytest
from drivetrain_roles.grpo.rewards import RewardError, compute_rewards, load_reward_function

PEER_FUNCTIONS = '''
def my_reward_fn(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward function (custom_reward_function.path / .name): one completion per call."""
    return len(solution_str) / 100


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl's built-in scorers' shape (gsm8k): no data_source, a dict return with its "score"."""
    answer = solution_str.split("=")[-1].strip()
    return {"score": score if answer == ground_truth else format_score - 0.5, "acc": answer == ground_truth}


def echo_extra_info(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if data_source is None and extra_info["prompt"].endswith("=") else -1.0


def reward_len(completions, **kwargs):
    """TRL's GRPO documentation example: prefer completions of about 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def needs_a_column(prompts, completions, answer_key):
    return [1.0] * len(completions)
'''

PROMPTS = ["Q: 12+7=", "Q: 3+4="]
COMPLETIONS = ["12+7=19", "a long answer that is wrong"]
REFERENCES = ["19", "7"]


@pytest.fixture
def peers(tmp_path):
    path = tmp_path / "peers.py"
    path.write_text(PEER_FUNCTIONS)
    return lambda name: f"{path}:{name}"


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("my_reward_fn", [7 / 100, 27 / 100]),
        ("compute_score", [1.0, -0.5]),  # graded and negative: the dict's "score"
        ("echo_extra_info", [1.0, 1.0]),
        ("reward_len", [-13.0, -7.0]),
    ],
)
def test_verl_and_trl_reward_functions_work_unchanged(peers, name, want):
    rewards = compute_rewards(peers(name), prompts=PROMPTS, completions=COMPLETIONS, references=REFERENCES)
    assert rewards.tolist() == pytest.approx(want)


def test_a_function_that_cannot_take_the_call_is_refused_when_it_loads(peers):
    """It was accepted at load and failed after the warm start, the model load and a step's generations."""
    with pytest.raises(RewardError) as error:
        load_reward_function(peers("needs_a_column"))
    message = str(error.value)
    assert "needs_a_column(prompts, completions, answer_key) cannot take drivetrain's call" in message
    assert "define needs_a_column(*, prompts, completions, references)" in message
    assert "compute_score(data_source, solution_str, ground_truth, extra_info=None)" in message


def test_drivetrain_grpo_refuses_it_before_the_warm_start(tmp_path, peers):
    from click.testing import CliRunner
    from drivetrain_engine_core.cli import main as drivetrain_cli

    run = tmp_path / "run"
    result = CliRunner().invoke(
        drivetrain_cli,
        ["grpo", "--output-dir", str(run), f"algorithm.reward_function={peers('needs_a_column')}"],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cannot take drivetrain's call" in result.output
    assert sorted(p.name for p in run.rglob("*")) == ["config.yaml"]  # no warm start, no model, no data
