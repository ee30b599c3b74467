"""Reward functions get the keywords their signatures name; verl's and TRL's shapes are taken as they are, every
data set column reaching them. Each peer's function below is written as its documentation shows it; the rewards
are the numbers each function's formula gives, computed here by hand."""

from __future__ import annotations

import json

import pytest
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.rl.reward_inputs import RewardInputs
from drivetrain_roles.rl.reward_settings import RewardSettings
from drivetrain_roles.rl.rewards import (
    RewardError,
    check_reward_inputs,
    compute_rewards,
    load_reward_function,
    score_completions,
)

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


def reads_verl_columns(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward function on verl's data: 1 + 10 x the row's index + 100 x correct, per source."""
    sign = 1.0 if data_source == "openai/gsm8k" else -1.0
    return sign * (1 + 10 * extra_info["index"] + 100 * (solution_str == ground_truth))


def accuracy(completions, answer, **kwargs):
    """TRL's shape reading a data set column (``answer``) by name."""
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def conversational(completion_messages, **kwargs):
    """TRL's conversational shape (its ``completions[i][0]["content"]``) under the keyword of the messages."""
    return [float(len(m[0]["content"])) + (m[0]["role"] == "assistant") for m in completion_messages]


def by_position(completions, /):
    return [0.0] * len(completions)
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


def verl_rows():
    """Two rows as verl's data sets hold them (``data_source``, ``reward_model.ground_truth``, ``extra_info``)."""
    rows = [
        {"prompt": "Q: 12+7=", "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "19"}},
        {"prompt": "Q: 3+4=", "data_source": "other", "reward_model": {"ground_truth": "7"}},
    ]
    return [
        Example(
            prompt_ids=[1],
            response_ids=[],
            prompt_text=row["prompt"],
            response_text="",
            has_reference=False,
            columns={**row, "extra_info": {"index": index}, "answer": row["reward_model"]["ground_truth"]},
            source=f"train.parquet row {index}",
        )
        for index, row in enumerate(rows)
    ]


def test_every_data_set_column_reaches_the_function_that_names_it(peers):
    inputs = RewardInputs.of(verl_rows(), ["19", "12+7=19", "7", "8"], [[4], [5, 6], [4], [4]])
    # verl: ground truth from reward_model, data_source and extra_info from their columns (2 completions a row).
    verl = score_completions(RewardSettings.single(peers("reads_verl_columns")), inputs)
    assert verl.total.tolist() == [1 + 0 + 100, 1 + 0 + 0, -(1 + 10 + 100), -(1 + 10 + 0)]
    # TRL: the answer column by name; the completions as messages.
    trl = RewardSettings(functions=(peers("accuracy"), peers("conversational")), weights=(1.0, 0.5))
    assert score_completions(trl, inputs).total.tolist() == [
        1.0 + 0.5 * 3,
        0.0 + 0.5 * 8,
        1.0 + 0.5 * 2,
        0.0 + 0.5 * 2,
    ]


def test_a_function_asking_for_what_the_data_lacks_is_refused_when_the_data_loads(peers):
    """It was accepted and failed after the warm start, the model load and a step's generations."""
    with pytest.raises(RewardError) as error:
        check_reward_inputs(RewardSettings.single(peers("needs_a_column")), verl_rows())
    message = str(error.value)
    assert f"reward function 'needs_a_column' ({peers('needs_a_column')}) asks for ['answer_key']" in message
    assert (
        "a reward function gets any of ['prompts', 'completions', 'completion_messages', 'completion_ids', "
        "'prompt', 'data_source', 'reward_model', 'extra_info', 'answer']"
    ) in message
    with pytest.raises(
        RewardError, match=r"by_position\(completions, /\) has parameters that can only be given by"
    ):
        load_reward_function(peers("by_position"))


def test_drivetrain_grpo_refuses_it_before_any_engine_starts(tmp_path, peers):
    from click.testing import CliRunner
    from drivetrain_engine_core._cli import main as drivetrain_cli
    from drivetrain_roles.jobs.default_assets import write_model_dir

    model_dir = write_model_dir(tmp_path / "model", seed=3)
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in range(4))
    )
    run = tmp_path / "run"
    result = CliRunner().invoke(
        drivetrain_cli,
        [
            "grpo",
            "--output-dir",
            str(run),
            f"model.path={model_dir}",
            f"data.train_files=[{data}]",
            "rollout.max_new_tokens=4",
            f"algorithm.reward_functions=[exact_match,{peers('needs_a_column')}]",
        ],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "asks for ['answer_key'], which the data does not offer" in result.output
    assert "'references', 'prompt', 'response']" in result.output  # the columns it could have named
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
