"""Several reward functions, weighted (TRL's rule: ``(values * weights).nansum``, a ``None`` left out of its
completion's sum), run concurrently within a time limit; graded and negative rewards; a function that raises on
one row or sleeps past the limit is one error naming it and the row, or the failure value with a counter. Every
expected number is worked out by hand in the comments."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.rl.reward_inputs import RewardInputs
from drivetrain_roles.rl.reward_settings import RewardSettings
from drivetrain_roles.rl.rewards import (
    RewardError,
    check_reward_inputs,
    compute_rewards,
    load_reward_function,
    reward_metrics,
    score_completions,
)

FUNCTIONS = '''
import threading
import time


def correct(completions, references, **kwargs):
    """Graded: 1 exact, 0.5 when the completion holds the reference, -1 otherwise; None where the reference is '?'."""
    return [
        None if r == "?" else 1.0 if c == r else 0.5 if r in c else -1.0 for c, r in zip(completions, references)
    ]


def brevity(completions):
    """Negative: -0.25 per character past the second."""
    return [-0.25 * max(0, len(c) - 2) for c in completions]


def only_long(completions):
    """Applies to completions of more than 3 characters only."""
    return [float(len(c)) if len(c) > 3 else None for c in completions]


def fragile(completions):
    """Raises ZeroDivisionError on a completion of 3 characters."""
    return [1.0 / (len(c) - 3) for c in completions]


def slow(completions):
    time.sleep(5)
    return [1.0] * len(completions)


def sleepy_a(completions):
    time.sleep(0.4)
    return [1.0] * len(completions)


sleepy_b = sleepy_c = sleepy_a


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's shape, one completion a call; stuck on '1x8'."""
    if solution_str == "1x8":
        time.sleep(5)
    return 1.0 if solution_str == ground_truth else 0.0


def on_main_thread(completions):
    return [float(threading.current_thread() is threading.main_thread())] * len(completions)
'''

PROMPTS = ["1+1=", "1+1=", "9+9=", "9+9="]
COMPLETIONS = ["2", "2 ok", "18", "1x8"]
REFERENCES = ["2", "2", "18", "?"]


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(FUNCTIONS)
    return lambda name: f"{path}:{name}"


def settings(*functions, weights=None, timeout_s=300.0, failure_value=None):
    return RewardSettings(
        functions=functions,
        weights=weights or (1.0,) * len(functions),
        timeout_s=timeout_s,
        failure_value=failure_value,
    )


def texts():
    return RewardInputs.of_texts(PROMPTS, COMPLETIONS, REFERENCES)


def test_weighted_sum_leaves_out_the_functions_that_return_none(spec):
    #            correct  brevity  only_long   weights 1, 2, 0.5
    # "2"         1.0      0        None     -> 1.0
    # "2 ok"      0.5     -0.5      4.0      -> 0.5 - 1.0 + 2.0 = 1.5
    # "18"        1.0      0        None     -> 1.0
    # "1x8"       None    -0.25     None     -> -0.5
    mixed = settings(spec("correct"), spec("brevity"), spec("only_long"), weights=(1.0, 2.0, 0.5))
    scores = score_completions(mixed, texts())
    assert scores.total.tolist() == [1.0, 1.5, 1.0, -0.5]
    assert scores.names == ("correct", "brevity", "only_long")
    # Each function's mean over the completions it applies to (TRL's rewards/<name>/mean).
    assert reward_metrics(scores) == {
        "reward/correct": pytest.approx(2.5 / 3),
        "reward/brevity": pytest.approx(-0.75 / 4),
        "reward/only_long": 4.0,
    }


def test_a_completion_no_function_applies_to_is_one_error(spec):
    with pytest.raises(RewardError) as error:
        score_completions(settings(spec("only_long")), texts())
    message = str(error.value)
    assert (
        "no reward function applies to completion 0 (prompt ...'1+1=', completion '2'...) (and 2 more)"
        in message
    )
    assert "every one of ['only_long'] returned None" in message


def examples_with_sources():
    return [
        Example(
            prompt_ids=[1],
            response_ids=[2],
            prompt_text=prompt,
            response_text=reference,
            columns={"prompt": prompt, "response": reference},
            source=f"train.jsonl row {row}",
        )
        for row, (prompt, reference) in enumerate([("1+1=", "2"), ("9+9=", "18")])
    ]


def test_a_function_raising_on_one_row_names_it_or_scores_the_failure_value(spec):
    inputs = RewardInputs.of(examples_with_sources(), COMPLETIONS, [[5]] * 4)
    with pytest.raises(RewardError) as error:
        score_completions(settings(spec("fragile")), inputs)
    assert (
        f"reward function 'fragile' ({spec('fragile')}) raised ZeroDivisionError: float division by zero on completion 3 "
        "(train.jsonl row 1, prompt ...'9+9=', completion '1x8'...)"
    ) in str(error.value)
    assert isinstance(error.value.__cause__, ZeroDivisionError)
    # Re-run row by row, the others keep their rewards: 1 / (len - 3) = -0.5, 1.0, -1.0; the failing one 0.
    scores = score_completions(settings(spec("fragile"), spec("brevity"), failure_value=0.0), inputs)
    assert scores.total.tolist() == [-0.5 + 0.0, 1.0 - 0.5, -1.0 + 0.0, 0.0 - 0.25]
    assert reward_metrics(scores)["reward/fragile/failed"] == 1.0
    assert reward_metrics(scores)["reward/brevity/failed"] == 0.0


def test_a_function_past_the_time_limit_never_hangs_the_step(spec):
    started = time.monotonic()
    with pytest.raises(RewardError) as error:
        score_completions(settings(spec("slow"), timeout_s=0.2), texts())
    assert (
        "reward function 'slow' (" in str(error.value)
        and "did not finish within algorithm.reward_timeout_s=0.2 s: 4 of 4 completions have no reward, the "
        "first completion 0"
        in str(error.value)
    )
    # With a failure value: the slow one scores it on every row, the fast one keeps its values (weights 1, 2).
    scores = score_completions(
        settings(spec("slow"), spec("brevity"), weights=(1.0, 2.0), timeout_s=0.2, failure_value=-1.0),
        texts(),
    )
    assert scores.total.tolist() == [-1.0, -1.0 - 1.0, -1.0, -1.0 - 0.5]
    assert reward_metrics(scores)["reward/slow/failed"] == 4.0
    # verl's per-completion function runs completion by completion: the one stuck on '1x8' fails alone.
    verl = score_completions(settings(spec("compute_score"), timeout_s=0.5, failure_value=0.0), texts())
    assert verl.total.tolist() == [1.0, 0.0, 1.0, 0.0] and verl.failed == (1,)
    assert time.monotonic() - started < 2.5


def test_functions_run_at_once_and_without_a_limit_on_the_calling_thread(spec):
    three = settings(spec("sleepy_a"), spec("sleepy_b"), spec("sleepy_c"))
    score_completions(three, texts())  # loaded once
    started = time.monotonic()
    assert score_completions(three, texts()).total.tolist() == [3.0] * 4
    assert time.monotonic() - started < 0.9  # 1.2 s one after another
    on_main = spec("on_main_thread")
    assert score_completions(settings(on_main, timeout_s=None), texts()).total.tolist() == [1.0] * 4
    assert score_completions(settings(on_main), texts()).total.tolist() == [0.0] * 4


def test_a_function_asking_for_references_of_prompt_only_data_is_refused_before_the_first_step():
    prompts = [
        Example(prompt_ids=[1], response_ids=[], prompt_text="1+1=", response_text="", has_reference=False)
    ]
    with pytest.raises(
        RewardError, match=r"'exact_match' \(exact_match\) asks for \['references'\].*response_key=null"
    ):
        check_reward_inputs(RewardSettings.single("exact_match"), prompts)


def test_math_verify_compares_answers_as_mathematics(monkeypatch):
    completions = [
        r"so \boxed{1/2}",
        "0.5",
        r"$\frac{1}{2}$",
        r"\boxed{2/3}",
        "no answer here",
        r"\boxed{(x+1)^2}",
    ]
    references = ["0.5", r"\frac{1}{2}", "1/2", "0.5", "0.5", "$x^2+2x+1$"]
    rewards = compute_rewards("math_verify", prompts=[""] * 6, completions=completions, references=references)
    assert rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    # A reference without an answer it can read: not applicable (None), as TRL's accuracy_reward.
    beside = settings("math_verify", "exact_match")
    scores = score_completions(beside, RewardInputs.of_texts(["", ""], ["abc", "1/2"], ["abc", "0.5"]))
    assert torch.isnan(scores.values[0, 0]) and scores.total.tolist() == [1.0, 1.0]
    # Without the extra: one line naming it.
    monkeypatch.setitem(sys.modules, "math_verify", None)
    load_reward_function.cache_clear()
    try:
        with pytest.raises(
            RewardError, match=r"'math_verify' needs a package .* pip install \"drivetrain-roles\[math\]\""
        ):
            load_reward_function("math_verify")
    finally:
        load_reward_function.cache_clear()


def test_one_setting_in_two_forms(tmp_path):
    # A layer that sets one form clears the other: the list on top of a file's single function, and back.
    (tmp_path / "two.yaml").write_text("algorithm:\n  reward_functions: [exact_match, step_credit]\n")
    config = load_config(tmp_path / "two.yaml", ["algorithm.reward_weights=[1.0,0.5]"])
    assert config.algorithm.rewards() == RewardSettings(
        functions=("exact_match", "step_credit"), weights=(1.0, 0.5)
    )
    assert load_config(
        tmp_path / "two.yaml", ["algorithm.reward_function=exact_match"]
    ).algorithm.rewards() == (RewardSettings.single("exact_match"))
    # The embedded task's own reward yields to a list.
    task = load_config(None, ["model.path=builtin:multistep", "algorithm.reward_functions=[exact_match]"])
    assert task.algorithm.rewards().functions == ("exact_match",)
    (tmp_path / "both.yaml").write_text(
        "algorithm:\n  reward_function: exact_match\n  reward_functions: [step_credit]\n"
    )
    with pytest.raises(
        ConfigError, match=r"are both set; write one: reward_functions=\[\.\.\.\] for several"
    ):
        load_config(tmp_path / "both.yaml")
    with pytest.raises(ConfigError, match=r"reward_weights=\[1\.0\] must hold one finite weight per reward"):
        load_config(tmp_path / "two.yaml", ["algorithm.reward_weights=[1.0]"])
    # No function: an environment's episodes are paid by its reward alone, so a job without one is refused.
    assert load_config(
        None, ["model.path=builtin:calculator", "algorithm.reward_functions=[]"]
    ).algorithm.rewards() == RewardSettings(functions=(), weights=())
    with pytest.raises(
        ConfigError, match=r"reward_functions=\[\] lists no reward function, and without an env"
    ):
        load_config(None, ["algorithm.reward_functions=[]"])
    # Two functions of one name are told apart by their files.
    names = (
        load_config(None, ["algorithm.reward_functions=[a/x.py:score,b/y.py:score]"])
        .algorithm.rewards()
        .names
    )
    assert names == ("x.score", "y.score")
