"""The embedded multi-step task: chains of 2-4 operations answered step by step, in a chat template.

``model.path=builtin:multistep`` selects it. Where the arithmetic task is 7-token prompts and 6-token answers, this
one has the shape of real post-training: every prompt is a conversation rendered by a Jinja chat template saved
with the tokenizer (``tokenizer.apply_chat_template``), opening with the same system prompt of over 300 tokens (more
than two 128-token KV blocks, shared by every request); answers are 20-100 tokens of working ending with the
template's turn end ``<|im_end|>``, which is not the tokenizer's EOS (as in a base model's tokenizer); the reward
(:mod:`drivetrain_roles.rl.step_credit`) is graded: partial credit per step, negative for malformed output.

The tokenizer is byte-level BPE without merges (one token per character), like Qwen's with its pre-tokenizer
and special tokens, so that loading it back as ``Qwen2Tokenizer`` (what transformers 5 does for the model type)
encodes exactly as it was built. Nothing is downloaded.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from .default_assets import write_splits

NAME = "multistep"
REWARD_FUNCTION = "step_credit"
"""The task's graded reward in ``algorithm.reward_function`` (:mod:`drivetrain_roles.rl.step_credit`)."""

EOS, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHARACTERS = "\n !'(),-.:;=?*+/0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
STEP_SEPARATOR, ANSWER_PREFIX = "; ", "answer: "

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's layout (each turn ``<|im_start|>role\\n...<|im_end|>\\n``) without its default system prompt."""

SYSTEM_PROMPT = (
    "You are a careful arithmetic assistant. The user gives a chain of operations on whole numbers, such as "
    "7+5*3-4. Work it out strictly from left to right, ignoring the usual precedence. Write each step as total, "
    "operator, number, equals sign and new total, separating the steps with a semicolon and a space. End with "
    "answer: and the final total."
)
"""Shared by every prompt: 343 characters, one token each (353 tokens as the rendered system turn; prompts share
368, up to the problem)."""

MODEL_CONFIG: dict[str, object] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "rope_theta": 10000.0,
}
"""A Qwen2-style decoder of 0.1 M parameters: 2 layers of width 64, two query heads of 32 sharing one KV head
(grouped-query attention; vLLM's CPU attention serves heads of 32 and up), positions for the system prompt, a
problem and its working. Width 128 learnt less in the same minutes: every sequence is mostly the system prompt."""

_PRE_TOKENIZER_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
"""Qwen2's pre-tokenizer split, which transformers 5 puts back when it loads the tokenizer as ``Qwen2Tokenizer``."""


def build_multistep_tokenizer(
    characters: str = CHARACTERS, chat_template: str = CHAT_TEMPLATE, words: Sequence[str] = ()
):
    """A byte-level fast tokenizer, one token per character of ``characters``, with ``chat_template``.

    EOS (and padding, as in Qwen's base tokenizers) is ``<|endoftext|>``; ``<|im_start|>`` and ``<|im_end|>``
    are special tokens of the template; there is no BOS. ``words`` are one token each but not special (decoding
    with ``skip_special_tokens`` keeps them): the calculator task's ``<tool_call>`` markup.

    Returns:
        A ``PreTrainedTokenizerFast`` (83 tokens with the defaults) that ``save_pretrained`` writes with
        ``chat_template.jinja``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # NOTE: byte-level symbols: a space is "Ġ" and a newline "Ċ" (byte + 256 below 33, printable ASCII itself).
    symbols = [chr(256 + ord(c)) if ord(c) < 33 else c for c in characters]
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (EOS, TURN_START, TURN_END)]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in words])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[TURN_START, TURN_END],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def write_multistep_model(path: Path, seed: int = 0) -> Path:
    """Write the task's model (random weights, a base model: its generation stops at EOS only) and tokenizer."""
    from .default_assets import write_model_dir

    return write_model_dir(path, seed=seed, tokenizer=build_multistep_tokenizer(), model_config=MODEL_CONFIG)


def working(start: int, operations: list[tuple[str, int]]) -> str:
    """The answer to ``start`` followed by ``operations`` from left to right: ``"7+5=12; 12*3=36; answer: 36"``."""
    steps, total = [], start
    for operator, number in operations:
        result = apply(total, operator, number)
        steps.append(f"{total}{operator}{number}={result}")
        total = result
    return STEP_SEPARATOR.join([*steps, f"{ANSWER_PREFIX}{total}"])


def apply(total: int, operator: str, number: int) -> int:
    """``total operator number`` for ``+``, ``-`` and ``*``."""
    return {"+": total + number, "-": total - number, "*": total * number}[operator]


def multistep_problem(rng: random.Random) -> tuple[int, list[tuple[str, int]]]:
    """A start in [1, 9] and 2-4 operations keeping every running total in [0, 99]: ``+``/``-`` by 1-9, ``*`` by
    2-3 (numbers the 0.1 M-parameter model learns to work with in minutes on a CPU)."""
    start = total = rng.randint(1, 9)
    count, operations = rng.choice((2, 3, 4)), list[tuple[str, int]]()
    while len(operations) < count:
        operator = rng.choice("+-*")
        number = rng.randint(2, 3) if operator == "*" else rng.randint(1, 9)
        if 0 <= apply(total, operator, number) <= 99:
            operations.append((operator, number))
            total = apply(total, operator, number)
    return start, operations


def multistep_example(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """One conversation: the system prompt, the problem, and the worked answer (the last, trained-on turn)."""
    start, operations = multistep_problem(rng)
    chain = f"{start}" + "".join(f"{operator}{number}" for operator, number in operations)
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Evaluate {chain}."},
            {"role": "assistant", "content": working(start, operations)},
        ]
    }


def write_multistep_data(directory: Path, *, train_size: int, val_size: int, seed: int) -> tuple[Path, Path]:
    """Write disjoint ``train.jsonl`` and ``val.jsonl`` sets of distinct problems (chat ``messages`` rows)."""
    rng, rows = random.Random(seed), dict[str, dict[str, list[dict[str, str]]]]()
    for _ in range(8 * (train_size + val_size)):
        row = multistep_example(rng)
        rows.setdefault(row["messages"][1]["content"], row)
        if len(rows) == train_size + val_size:
            break
    return write_splits(
        directory, list(rows.values()), train_size=train_size, val_size=val_size, what="problems were drawn"
    )
