"""A reward model in a multi-turn job scores the whole episode: the conversation's messages (the question, each
model turn with its tool calls, each tool result) rendered with the reward model's own chat template, not the
question and the final turn alone.

Two ``drivetrain grpo`` steps in the registered ``calculator`` environment (the ``calculator_grpo`` fixture),
every turn played by a scripted rollout (each question's calls and answer are known here), the real actor
training on the episodes, a tiny Qwen2 sequence classifier as the only weighted reward. The conversations are
written out here from the script's table and scored by a plain Hugging Face
``AutoModelForSequenceClassification`` forward; each step's ``reward/judge`` and each held-out
``val/reward/judge`` equal those scores within 1e-5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.testing import make_tiny_model_dir

PLAYS = {"6*7+8": (2, "49"), "4*5": (1, "20"), "9-3": (1, "7"), "2+2": (0, "5")}
"""Each question's calculator calls before the answer, and the answer given."""
TRAIN, HELD_OUT = ["6*7+8", "4*5"], ["9-3", "2+2"]
RM_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}[{{ m['name'] }} returned] {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %} => {{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}</s>\n"
    "{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
)
"""The reward model's template, not the policy's ChatML: its own rendering of tool calls and tool results."""

RECORDER = """
import json


def question(prompts):
    with open({log!r}, "a") as log:
        log.write(json.dumps(list(prompts)) + "\\n")
    return [0.0] * len(prompts)
"""


def call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def conversation(expression: str) -> list[dict]:
    """The episode of a question as chat messages, written from the table (the test's own arithmetic)."""
    calls, answer = PLAYS[expression]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    messages: list[dict] = [{"role": "user", "content": f"What is {expression}?"}]
    for _ in range(calls):
        messages.append({"role": "assistant", "content": call_text(expression), "tool_calls": [call]})
        messages.append({"role": "tool", "name": "calculator", "content": str(eval(expression))})
    return [*messages, {"role": "assistant", "content": answer}]


def hf_scores(folder: Path, conversations: dict[str, list[dict]]) -> dict[str, float]:
    """A plain Hugging Face forward of each conversation rendered by the reward model's template, by key."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    scores = {}
    for key, messages in conversations.items():
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            scores[key] = float(model(input_ids=ids["input_ids"]).logits[0, 0])
    return scores


def reward_model(root: Path) -> Path:
    """A tiny Qwen2 one-label sequence classifier on the policy's character vocabulary, its template
    :data:`RM_TEMPLATE` (random weights, the head scaled up so that conversations score apart)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    lm = make_tiny_model_dir(root / "lm", arch="qwen2", hidden_size=64, max_position_embeddings=1024)
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(lm, num_labels=1), dtype=torch.float32
    )
    with torch.no_grad():
        model.score.weight *= 20.0
    target = root / "judge"
    model.save_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(lm)
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(target)
    return target


def write_rows(path: Path, expressions: list[str]) -> None:
    """The questions as one-message conversations, the calculator's ``answer`` beside them."""
    rows = [
        {"messages": [{"role": "user", "content": f"What is {e}?"}], "answer": str(eval(e))}
        for e in expressions
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def overrides(tmp_path: Path, judge: Path) -> list[str]:
    """The job's data and rewards: the questions as chat data, the recorder and the reward model weighted 1
    each, one question a step (played twice)."""
    write_rows(tmp_path / "train.jsonl", TRAIN)
    write_rows(tmp_path / "val.jsonl", HELD_OUT)
    return [
        f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.val_files=[{tmp_path / 'val.jsonl'}]",
        "data.messages_key=messages",
        "data.response_key=null",
        f"algorithm.reward_functions=[{tmp_path / 'recorder.py'}:question,{judge}]",
        "algorithm.reward_weights=[1.0,1.0]",
        "trainer.prompts_per_step=1",
    ]


def test_a_reward_model_scores_each_episodes_whole_conversation(tmp_path, calculator_grpo):
    """One question per step (``rollout.n=2``, the same scripted episode twice): each step's ``reward/judge``
    is the HF score of that question's whole conversation (two calls and results, or one), and each held-out
    ``val/reward/judge`` the mean over its two episodes (one call; none); the question and final turn alone
    score otherwise (as they did before the episode was scored whole)."""
    judge = reward_model(tmp_path / "rm")
    log = tmp_path / "seen.jsonl"
    (tmp_path / "recorder.py").write_text(RECORDER.format(log=str(log)))
    records = calculator_grpo(tmp_path, PLAYS, *overrides(tmp_path, judge))

    whole = hf_scores(judge, {e: conversation(e) for e in PLAYS})
    last_turn = hf_scores(judge, {e: [conversation(e)[0], conversation(e)[-1]] for e in PLAYS})
    for e in ["6*7+8", "4*5", "9-3"]:
        assert abs(whole[e] - last_turn[e]) > 1e-2, e  # the calls and results move the score
    batches = [
        {re.search(r"What is (\S+)\?", p).group(1) for p in b}
        for b in map(json.loads, log.read_text().splitlines())
    ]
    played = [expression for batch in batches if len(batch) == 1 for expression in batch]  # held out: 2 each
    steps = [r for r in records if "train/reward" in r]
    assert len(steps) == 2 and sorted(played) == sorted(TRAIN)
    for record, expression in zip(steps, played, strict=True):
        assert record["reward/judge"] == pytest.approx(whole[expression], abs=1e-5), expression
        environment = float(PLAYS[expression][1] == str(eval(expression)))  # the calculator's exact match
        assert record["train/reward"] == pytest.approx(environment + whole[expression], abs=1e-5)
    evaluations = [r for r in records if "val/reward" in r]
    assert len(evaluations) == 2
    for record in evaluations:
        expected = sum(whole[e] for e in HELD_OUT) / 2
        assert record["val/reward/judge"] == pytest.approx(expected, abs=1e-5)
