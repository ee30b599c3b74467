"""The embedded calculator task: multi-digit arithmetic a 0.1 M-parameter model cannot do in its head, but can
with the ``calculator`` tool (:mod:`drivetrain_roles.environments.calculator`).

``model.path=builtin:calculator`` selects it. Each row holds two conversations of the same question, as chat
messages: ``messages``, the tool-use trajectory (the assistant writes a ``<tool_call>``, the ``tool`` message
returns the value, the assistant answers with it), and ``direct``, the same question answered without tools; and
the ``answer``. ``drivetrain sft model.path=builtin:calculator`` teaches the call format from ``messages``;
``data.messages_key=direct`` is the same job without tools. ``mixed`` is what ``grpo``'s warm start learns from:
``messages`` in every other training row (and every held-out one, so the held-out reference is the answer), in
the others a guess under the same tool prompt, ``Guess 347*528+915 = 184131`` (no answer the reward accepts, and
beyond the model in its head), so GRPO has a choice to learn: call, then copy.

NOTE: a guess restates the question's expression at the distance a call's expression sits from it (``Guess ``
is six tokens, as the call's markup before the expression is), so the copy a call needs is trained on every row;
restated without it, a warm start copied into 95 of 96 guesses and 4 of 100 calls. Half the rows call the tool so
that the answer's copy of the tool's value is learnt too (with a third: 18 of 100 answers after a right call).

The tokenizer is the multi-step task's one token per character, with ``{}"_`` added and the call's markup and
JSON keys (:data:`CALL_WORDS`) as one non-special token each: a call is learnt as markup rather than spelt out,
and a decoded turn (special tokens skipped) still holds it for the tool-call parser. The chat template renders an
assistant's ``tool_calls`` as Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks and ``tool`` messages as
their own turns; it does not render ``tools=``: the system prompt names the tool, so SFT rows (rendered without
tools) and episodes (rendered with the environment's schemas) are the same tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from ..environments.calculator import calculator
from .default_assets import write_model_dir, write_splits
from .multistep_task import CHARACTERS, MODEL_CONFIG, build_multistep_tokenizer

NAME = "calculator"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
CALL_WORDS = (
    TOOL_CALL_START,
    TOOL_CALL_END,
    '{"name": ',
    '"calculator"',
    ', "arguments": ',
    '{"expression": ',
)
"""One token each, as a real BPE vocabulary holds JSON keys in a few: a call is a handful of tokens of markup
around the expression, not 63 characters, so the model copies the question from about 20 tokens back."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>' + {'name': function['name'], 'arguments': function['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML turns; an assistant's ``tool_calls`` (``{"type": "function", "function": {"name", "arguments"}}``, as
transformers' chat templates take them) as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

TOOL_PROMPT = "Use the calculator: write a <tool_call>, then answer with its number."
DIRECT_PROMPT = "Answer with the number."

FORMS = ("{a}*{b}+{c}", "{c}+{a}*{b}")
"""The shapes of the questions: a product of two 3-digit numbers plus a third."""


def build_calculator_tokenizer():
    """The multi-step task's tokenizer with the characters of JSON calls and :data:`CALL_WORDS`."""
    return build_multistep_tokenizer(CHARACTERS + '{}"_', CHAT_TEMPLATE, words=CALL_WORDS)


def write_calculator_model(path: Path, seed: int = 0) -> Path:
    """Write the task's model (random weights, the multi-step task's shape) and tokenizer."""
    return write_model_dir(path, seed=seed, tokenizer=build_calculator_tokenizer(), model_config=MODEL_CONFIG)


def calculator_problem(rng: random.Random) -> str:
    """One expression such as ``"347*528+915"``, with a 6-digit value.

    NOTE: every question and answer has the same length (factors in [317, 999], so their product has 6 digits,
    and a 3-digit addend that keeps it there), so a call copies the question, and the answer the tool's
    result, from a fixed distance. Measured in SFT: 2-3 numbers of 2-3 digits (copies from varying distances,
    an induction head's work) held the loss at 0.42 nats from step 100 to 370, every copied digit unlearnt;
    fixed lengths learnt in 500 steps to copy the result but not the question 50 characters back (0 of 100
    held-out calls right); with :data:`CALL_WORDS` making that about 20 tokens, 96-100 of 100 after 1,000
    steps (seeds 0-2; the copy is learnt abruptly, after 500 steps the seeds scored 100, 0 and 25).
    """
    form = rng.choice(FORMS)
    return form.format(a=rng.randint(317, 999), b=rng.randint(317, 999), c=rng.randint(100, 999))


def calculator_example(expression: str, *, in_head: bool = False) -> dict[str, Any]:
    """The row of one question: its tool-use trajectory, its direct answer, the answer, and ``mixed``: the
    tool-use trajectory, or with ``in_head`` a guess without a call under the same tool prompt."""
    answer = calculator(expression)
    question = {"role": "user", "content": f"What is {expression}?"}
    call = {"type": "function", "function": {"name": NAME, "arguments": {"expression": expression}}}
    messages = [
        {"role": "system", "content": TOOL_PROMPT},
        question,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": NAME, "content": answer},
        {"role": "assistant", "content": answer},
    ]
    return {
        "messages": messages,
        "mixed": [*messages[:2], {"role": "assistant", "content": f"Guess {expression} = {answer}"}]
        if in_head
        else messages,
        "direct": [
            {"role": "system", "content": DIRECT_PROMPT},
            question,
            {"role": "assistant", "content": answer},
        ],
        "answer": answer,
    }


def write_calculator_data(directory: Path, *, train_size: int, val_size: int, seed: int) -> tuple[Path, Path]:
    """Write disjoint ``train.jsonl`` and ``val.jsonl`` sets of distinct questions; every other training row's
    ``mixed`` is a guess."""
    rng, expressions = random.Random(seed), dict[str, None]()
    for _ in range(4 * (train_size + val_size)):
        expressions[calculator_problem(rng)] = None
        if len(expressions) == train_size + val_size:
            break
    rows = [calculator_example(e, in_head=i < train_size and i % 2 == 1) for i, e in enumerate(expressions)]
    return write_splits(
        directory, rows, train_size=train_size, val_size=val_size, what="questions were drawn"
    )
