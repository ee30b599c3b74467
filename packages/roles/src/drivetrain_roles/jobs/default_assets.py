"""The embedded default job: a tiny model, its own arithmetic tokenizer and a generated data set.

``drivetrain sft`` with no arguments trains this on CPU in about a minute. Nothing is downloaded: the
tokenizer is built with the ``tokenizers`` library, the model directory is written from a config with
random weights (then loaded back through ``from_pretrained`` like any user model), and the data are
addition questions (``"12+7="`` -> ``"19"``) written as JSONL, so the default run reads data through the
same loader as a user's files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BUILTIN_MODEL = "builtin:arithmetic"
"""``model.path`` value that selects the embedded tiny model (built under the run's output directory)."""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ALPHABET = "0123456789+-*= "

TINY_MODEL_CONFIG: dict[str, object] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "rope_theta": 10000.0,
}
"""A Qwen2-style decoder: 2 layers of width 64, about 0.1 M parameters.

Two attention heads of 32 (not four of 16, which have the same parameter shapes): vLLM's CPU attention serves
heads of 32 and up, so ``drivetrain grpo rollout.name=vllm`` can run this default on CPU.
"""


def build_arithmetic_tokenizer():
    """A character-level fast tokenizer over digits, ``+-*=`` and space, with pad/bos/eos.

    Encoding with special tokens (``tokenizer(prompt)``) prepends bos, as the SFT data do, so the saved
    tokenizer reproduces the training inputs.

    Returns:
        A ``PreTrainedTokenizerFast`` (18 tokens) that ``save_pretrained`` writes as a normal tokenizer
        directory.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate([PAD, BOS, EOS, *ALPHABET])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def write_model_dir(
    path: Path,
    seed: int = 0,
    *,
    tokenizer: Any = None,
    model_config: Mapping[str, object] = TINY_MODEL_CONFIG,
) -> Path:
    """Write a tiny Qwen2-style model with random weights to ``path``: ``model_config``'s shape, and ``tokenizer``
    (default: the arithmetic one) with its vocabulary and special tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_arithmetic_tokenizer() if tokenizer is None else tokenizer
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **model_config,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def arithmetic_examples(count: int, seed: int, max_operand: int = 49) -> list[dict[str, str]]:
    """``count`` addition questions ``"a+b="`` with answers ``"a+b"`` evaluated, operands in [0, max_operand]."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        examples.append({"prompt": f"{a}+{b}=", "response": str(a + b)})
    return examples


def write_arithmetic_data(directory: Path, *, train_size: int, val_size: int, seed: int) -> tuple[Path, Path]:
    """Write disjoint ``train.jsonl`` and ``val.jsonl`` arithmetic sets; returns their paths."""
    examples = arithmetic_examples(4 * (train_size + val_size), seed)
    unique = list({e["prompt"]: e for e in examples}.values())
    return write_splits(
        directory, unique, train_size=train_size, val_size=val_size, what="arithmetic questions exist"
    )


def write_splits(
    directory: Path, unique: list[dict[str, Any]], *, train_size: int, val_size: int, what: str
) -> tuple[Path, Path]:
    """Write the first ``train_size`` of ``unique`` (distinct generated rows) to ``train.jsonl`` and the next
    ``val_size`` to ``val.jsonl``; returns their paths.

    Raises:
        ValueError: fewer than ``train_size + val_size`` distinct rows (``what`` says which: "problems were drawn").
    """
    if len(unique) < train_size + val_size:
        raise ValueError(
            f"only {len(unique)} distinct {what}; ask for fewer than "
            f"{train_size + val_size} (data.generated_train_size + data.generated_val_size)."
        )
    directory.mkdir(parents=True, exist_ok=True)
    paths = (directory / "train.jsonl", directory / "val.jsonl")
    splits = (unique[:train_size], unique[train_size : train_size + val_size])
    for path, split in zip(paths, splits, strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in split))
    return paths
