"""The embedded calculator task (``model.path=builtin:calculator``) and its ``calculator`` environment.

The tool refuses everything but arithmetic on bounded numbers, and its errors reach the model as ``tool``
messages; the data are the same bytes for the same seed; the chat template renders a tool-call conversation the
tokenizer round-trips, with the SFT loss on exactly the two assistant turns; and episodes scripted through the
registered ``calculator`` environment earn 1 for the right answer and 0 for a wrong one or none.
"""

from __future__ import annotations

import json
import re

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import ModelTurn, environment_factory
from drivetrain_engine_core.rollout import SamplingConfig
from drivetrain_roles.environments.calculator import CalculatorEnvironment, CalculatorError, calculator
from drivetrain_roles.jobs.builtin_tasks import builtin_task
from drivetrain_roles.jobs.calculator_task import (
    TOOL_CALL_START,
    build_calculator_tokenizer,
    calculator_example,
    write_calculator_data,
)
from drivetrain_roles.jobs.data import tokenize_messages, tokenize_row
from drivetrain_roles.jobs.multistep_task import TURN_END
from drivetrain_roles.rollout.multi_turn import run_episodes
from drivetrain_roles.rollout.turn_limits import TurnLimits


@pytest.mark.parametrize(
    ("expression", "value"),
    [("347*28+915", "10631"), ("(2+3)*-4", "-20"), ("7/2", "3.5"), ("7//2 + 7%2", "4"), ("2**10", "1024")],
)
def test_the_calculator_evaluates_arithmetic_exactly(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "refusal"),
    [
        ("__import__('os').system('true')", "only numbers"),  # a call
        ("x + 1", "only numbers"),  # a name
        ("(1).real", "only numbers"),  # an attribute
        ("[1, 2]", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("9**9**9", "exponents must be whole numbers between -64 and 64"),
        ("2**0.5", "exponents must be whole numbers"),
        ("10**50 * 10**50 * 10**50", "more than 60 digits"),
        ("1" * 61, "more than 60 digits"),
        ("1e999 - 1e999", "not a finite number"),
        ("True + True", "only numbers"),
        ("1+" * 150 + "1", "at most 200 characters"),
        ("1/0", "division by zero"),
        ("5 % (3-3)", "division by zero"),
        ("0**-1", "division by zero"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_all_but_bounded_arithmetic(expression, refusal):
    with pytest.raises(CalculatorError, match=re.escape(refusal)):
        calculator(expression)


def test_a_refusal_reaches_the_model_as_a_tool_message():
    """What the model reads after a call that divides by zero or names a function: an ``Error:`` tool message."""
    import asyncio

    environment = CalculatorEnvironment()
    asyncio.run(environment.reset(calculator_example("12*34")))
    calls = "".join(
        f'{TOOL_CALL_START}{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}</tool_call>'
        for e in ("1/0", "abs(-1)", "12*34")
    )
    result = asyncio.run(environment.step(ModelTurn(text=calls, token_ids=(), turn=0)))
    assert [m["content"] for m in result.observation] == [
        "Error: the tool 'calculator' raised CalculatorError: division by zero",
        "Error: the tool 'calculator' raised CalculatorError: only numbers and + - * / // % ** are allowed, "
        "not 'abs(-1)'",
        "408",
    ]
    assert not result.done and result.info == {"tool_calls": 3, "tool_errors": 2}


def test_the_data_are_the_same_for_a_seed_and_answers_are_the_expressions_values(tmp_path):
    paths = [
        write_calculator_data(tmp_path / f"{seed}-{run}", train_size=40, val_size=10, seed=seed)
        for seed, run in ((0, 0), (0, 1), (1, 0))
    ]
    texts = [[p.read_text() for p in pair] for pair in paths]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    train, val = ([json.loads(line) for line in text.splitlines()] for text in texts[0])
    questions = [row["messages"][1]["content"] for row in train + val]
    assert len(train) == 40 and len(val) == 10 and len(set(questions)) == 50
    for row in train + val:
        expression = re.fullmatch(r"What is ([0-9*+-]+)\?", row["messages"][1]["content"]).group(1)
        # the reference: products first, then sums and differences, on Python integers
        terms = re.split(r"([+-])", expression)
        total = sum(
            (-1 if sign == "-" else 1) * _product(term)
            for sign, term in zip(["+", *terms[1::2]], terms[0::2], strict=True)
        )
        assert row["answer"] == str(total) == row["messages"][-1]["content"] == row["direct"][-1]["content"]
        assert row["messages"][3] == {"role": "tool", "name": "calculator", "content": str(total)}


def test_the_mixed_rows_call_the_tool_in_half_and_guess_at_the_calls_distance_otherwise(tmp_path):
    """``mixed`` (what the grpo/ppo warm start learns from) is the tool-use trajectory in every other training row
    (and every held-out row, whose last turn is the reference) and, in the others, a guess under the same tool
    prompt that restates the expression where a call writes it: six tokens after the assistant turn opens, so the
    copy a call needs is trained on every row."""
    train, val = write_calculator_data(tmp_path, train_size=30, val_size=3, seed=0)
    rows, held_out = ([json.loads(line) for line in path.read_text().splitlines()] for path in (train, val))
    calls = [any("tool_calls" in m for m in row["mixed"]) for row in rows]
    assert calls == [i % 2 == 0 for i in range(30)] and all(
        row["mixed"] == row["messages"] for row in held_out
    )
    tokenizer = build_calculator_tokenizer()
    for row, called in zip(rows, calls, strict=True):
        assert row["mixed"][:2] == row["messages"][:2]
        expression = re.fullmatch(r"What is (.*)\?", row["messages"][1]["content"]).group(1)
        guess = {"role": "assistant", "content": f"Guess {expression} = {row['answer']}"}
        assert row["mixed"] == (row["messages"] if called else [*row["messages"][:2], guess])
        turn = tokenizer.apply_chat_template(row["mixed"][:3], tokenize=False).split(
            "<|im_start|>assistant\n"
        )[1]
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(turn, add_special_tokens=False)["input_ids"])
        assert "".join(tokens[6:17]) == expression  # the call's and the guess's expression: tokens 6 to 16


def test_the_grpo_preset_warms_up_on_the_mixed_rows():
    from drivetrain_roles.grpo.config import load_config

    config = load_config(None, ["model.path=builtin:calculator"])
    assert config.data.messages_key == "mixed" and config.trainer.warm_start_steps == 1000
    assert config.environment.name == "calculator" and config.environment.options == {}


def _product(term: str) -> int:
    product = 1
    for factor in term.split("*"):
        product *= int(factor)
    return product


def test_the_template_renders_a_tool_conversation_the_tokenizer_round_trips_and_sft_trains_on_both_turns():
    tokenizer = build_calculator_tokenizer()
    row = calculator_example("347*28+915")
    text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*28+915"}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>tool\n10631<|im_end|>\n" in text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"]  # markup and JSON keys: a token each
    keys = ['{"name": ', '"calculator"', ', "arguments": ', '{"expression": ']
    assert tokenizer.convert_ids_to_tokens(call_ids) == [
        "<tool_call>",
        *keys,
        '"',
        *"347*28+915",
        '"',
        "}",
        "}",
        "</tool_call>",
    ]
    # decoded as an environment reads a turn (special tokens skipped), the call is still there
    assert call in tokenizer.decode(ids, skip_special_tokens=True)

    example = tokenize_messages(row["messages"], tokenizer, "row 0", earlier_turns=True)
    ((start, end),) = example.earlier_turn_spans
    assert tokenizer.decode(example.prompt_ids[start:end]) == f"{call}{TURN_END}\n"
    assert tokenizer.decode(example.response_ids) == f"10631{TURN_END}\n<|endoftext|>"


def test_episodes_through_the_registered_environment_earn_one_for_the_right_answer_only(scripted_rollout):
    """Four scripted players on ``12*34+5`` (413): call then copy the result (1), call then answer wrongly (0),
    answer in the head (wrongly, 0), and call forever (no answer by the turn limit, 0)."""
    tokenizer = build_calculator_tokenizer()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34+5"}}</tool_call>'
    scripts = {
        "copies": lambda context: call if context.count("<|im_start|>tool") == 0 else "413",
        "miscopies": lambda context: call if context.count("<|im_start|>tool") == 0 else "412",
        "guesses": lambda context: "400",
        "loops": lambda context: call,
    }
    sampling = SamplingConfig(max_new_tokens=120, stop_token_ids=(tokenizer.convert_tokens_to_ids(TURN_END),))
    row = calculator_example("12*34+5")
    rewards = {}
    for name, script in scripts.items():
        (trajectory,) = run_episodes(
            scripted_rollout(tokenizer, script),
            tokenizer,
            environment_factory("calculator"),
            [row],
            sampling,
            TurnLimits(max_turns=3, max_total_tokens=512, step_timeout_s=10),
        )
        rewards[name] = (sum(trajectory.turn_rewards), trajectory.stop_reason)
    assert rewards == {
        "copies": (1.0, "done"),
        "miscopies": (0.0, "done"),
        "guesses": (0.0, "done"),
        "loops": (0.0, "max_turns"),
    }
    # the trajectory holds the tool's answer, rendered by the template, as context (loss mask 0)
    assert "<|im_start|>tool\n413<|im_end|>" in tokenizer.decode(trajectory.input_ids)


CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
PLAYERS = {
    "calls": lambda expression, answer, called: answer if called else CALL.format(expression),
    "guesses": lambda expression, answer, called: f"Guess {expression} = {answer}",  # the warm start's guess
    "answers": lambda expression, answer, called: answer,  # right, in the head
    "misses": lambda expression, answer, called: str(int(answer) + 1),
}
"""What a scripted player writes in a turn of ``expression`` (its value ``answer``), ``called``: after a call."""


def _preset_episodes(scripted_rollout, rows: dict[str, tuple[dict, str]]):
    """The ``grpo`` preset of ``builtin:calculator``, its episode pipeline over ``rows`` (expression -> row and
    player; two episodes each, as a group), the rows' examples as the trainer reads them, and its tokenizer."""
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.rl.episodes import EpisodePipeline

    config = load_config(None, ["model.path=builtin:calculator", "trainer.progress_bar=false"])
    tokenizer = build_calculator_tokenizer()

    def script(context: str) -> str:
        expression = re.search(r"What is (\S+)\?", context).group(1)
        row, player = rows[expression]
        return PLAYERS[player](expression, row["answer"], "<|im_start|>tool" in context)

    examples = [tokenize_row(row, tokenizer, config.data, where=e) for e, (row, _) in rows.items()]
    sampling = SamplingConfig(n=2, max_new_tokens=config.rollout.max_new_tokens)
    pipeline = EpisodePipeline.configured(
        config.environment,
        scripted_rollout(tokenizer, script),
        lambda step: ([], sampling),
        rows=lambda step: [e.columns for e in examples],
        tokenizer=tokenizer,
        version=0,
        first=0,
        last=1,
        lag=None,
    )
    return config, pipeline, examples, tokenizer


def test_the_grpo_preset_pays_the_environments_reward_alone(scripted_rollout):
    """Each player on a tool-use row and on a guess row (whose ``mixed`` reference is the guess): the preset pays
    1 for the right answer, after a call or not, and 0 for a wrong one or the guess restated, whatever the row
    (with exact_match beside the environment's reward it paid 2, 0, 2, 0 on the tool row and 1, 1, 1, 0 on the
    guess row); held-out, val/reward is val/accuracy's fraction, 1 when every answer is right (it read 2)."""
    from drivetrain_roles.grpo.step import episodes_batch
    from drivetrain_roles.rl.held_out import held_out_evaluation
    from drivetrain_roles.rl.scoring import RewardScorer

    expressions = ["347*528+915", "612*731+408", "905+318*477", "556*802+133"]
    expressions += ["721*364+250", "488+913*645", "379*590+812", "834*427+666"]
    rows = {
        e: (calculator_example(e, in_head=i >= 4), player)
        for i, (e, player) in enumerate(zip(expressions, [*PLAYERS, *PLAYERS], strict=True))
    }
    assert rows["721*364+250"][0]["mixed"][-1]["content"] == "Guess 721*364+250 = 262694"
    config, pipeline, examples, tokenizer = _preset_episodes(scripted_rollout, rows)
    generated = pipeline.take(0)
    scores = RewardScorer(config.algorithm.rewards(), tokenizer)(
        examples, generated.output, generated.trajectories
    )
    rewards = episodes_batch(generated, scores, config, None, step=0).rewards
    # calls, guesses, answers, misses on the tool rows, then the guess rows; two episodes each
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0] * 2
    assert config.algorithm.rewards().label == "environment"

    right = [e for e, (_, player) in rows.items() if player in ("calls", "answers")]
    _, pipeline, held_out, _ = _preset_episodes(
        scripted_rollout, {e: (calculator_example(e), rows[e][1]) for e in right}
    )
    assert held_out_evaluation(held_out, pipeline, tokenizer, config) == {
        "val/accuracy": 1.0,
        "val/reward": 1.0,
    }


def test_the_task_brings_chat_rows_and_sft_settings():
    task = builtin_task("builtin:calculator")
    assert task is not None and task.defaults["sft"]["data"]["messages_key"] == "messages"


def _calculator_job(tmp_path, *overrides: str):
    from drivetrain_roles.grpo.config import load_config
    from drivetrain_roles.grpo.trainer import GRPOTrainer

    shrunk = ["warm_start_steps=2", "warm_start_batch_size=2", "total_steps=1", "prompts_per_step=2"]
    shrunk += ["eval_every=1", "eval_samples=3", "save_every=0", "progress_bar=false"]
    config = load_config(
        None,
        [
            "model.path=builtin:calculator",
            *(f"trainer.{o}" for o in shrunk),
            "rollout.n=2",
            "data.generated_train_size=4",
            "data.generated_val_size=3",
            *overrides,
        ],
    )
    return GRPOTrainer(config, tmp_path / "run")


def test_an_episode_limit_over_the_models_positions_is_refused_before_training(tmp_path):
    """An episode grows to environment.max_total_tokens, observations included: a limit over the model's 512
    positions is refused when the prompts load, not when the first long episode reaches the rollout."""
    job = _calculator_job(tmp_path, "environment.max_total_tokens=600")
    with pytest.raises(ConfigError, match=r"environment.max_total_tokens .* is 600 tokens, over the model's"):
        job.run()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_held_out_evaluation_plays_one_greedy_episode_per_prompt(tmp_path, monkeypatch):
    """In an environment, evaluation answers each held-out prompt with one greedy episode: the reward functions
    score its last model turn against the reference, and val/reward adds the environment's reward, as training
    does (here a function that scores 0.25 each, set beside the preset's environment reward, and the
    environment's 1 for an exact final answer)."""
    from drivetrain_roles.rl import rewards

    seen: list[tuple[list[str], list[str]]] = []

    def quarter(*, completions, references):
        seen.append((completions, references))
        return [0.25] * len(completions)

    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "exact_match", quarter)
    rewards.load_reward_function.cache_clear()
    try:
        _calculator_job(tmp_path, "algorithm.reward_function=exact_match").run()
    finally:
        rewards.load_reward_function.cache_clear()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "val/reward" in r]
    held_out = [call for call in seen if len(call[0]) == 3]
    assert [r["step"] for r in evaluations] == [0, 1] and len(held_out) == 2
    for evaluation, (completions, references) in zip(evaluations, held_out, strict=True):
        # The environment pays 1 for a final turn that is the answer and holds no call.
        pairs = zip(completions, references, strict=True)
        exact = [float(c.strip() == r and "<tool_call>" not in c) for c, r in pairs]
        assert evaluation["val/reward"] == pytest.approx(0.25 + sum(exact) / 3, abs=1e-6)
        assert evaluation["val/accuracy"] == pytest.approx(sum(exact) / 3, abs=1e-6)
