"""The embedded preference data: addition questions with the correct sum chosen and a wrong one rejected.

The questions are the SFT job's (:func:`~drivetrain_roles.sft.default_assets.arithmetic_examples`); the wrong
answer is the sum off by 1 to 10 (never negative), the near misses a model that half-learned addition makes.
Files are JSONL with ``prompt``/``chosen``/``rejected``, read by the same loader as a user's files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..sft.default_assets import arithmetic_examples

MAX_OFFSET = 10


def arithmetic_pairs(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` distinct questions, each with its correct sum (chosen) and a near-miss (rejected).

    Raises:
        ValueError: fewer distinct questions exist than asked for.
    """
    examples = list({e["prompt"]: e for e in arithmetic_examples(4 * count, seed)}.values())
    if len(examples) < count:
        raise ValueError(
            f"only {len(examples)} distinct arithmetic questions exist; ask for fewer than {count} pairs "
            "(data.generated_train_size + data.generated_val_size)."
        )
    rng = random.Random(seed + 1)
    pairs = []
    for example in examples[:count]:
        right = int(example["response"])
        offsets = [d for d in range(-MAX_OFFSET, MAX_OFFSET + 1) if d and right + d >= 0]
        wrong = right + rng.choice(offsets)
        pairs.append({"prompt": example["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return pairs


def write_arithmetic_pairs(
    directory: Path, *, train_size: int, val_size: int, seed: int
) -> tuple[Path, Path]:
    """Write disjoint ``train.jsonl`` and ``val.jsonl`` pair sets; returns their paths."""
    pairs = arithmetic_pairs(train_size + val_size, seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = (directory / "train.jsonl", directory / "val.jsonl")
    for path, split in zip(paths, (pairs[:train_size], pairs[train_size:]), strict=True):
        path.write_text("".join(json.dumps(p) + "\n" for p in split))
    return paths
