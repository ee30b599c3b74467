"""The embedded preference data: addition questions with the correct sum chosen and a wrong one rejected.

The questions are the SFT job's (:func:`~drivetrain_roles.jobs.default_assets.arithmetic_examples`); the wrong
answer is the sum off by 1 to 10 (never negative, each offset equally likely), the near misses a model that
half-learned addition makes (off by 10 is a dropped or spurious carry). A training question can come with
several different wrong answers (``rejected_per_prompt``): with one fixed near miss per question a reward
model memorises its training pairs (held-out loss rises while training loss falls) instead of learning to
check the sum. Held-out questions keep one pair each, so held-out accuracy counts independent questions.
Files are JSONL with ``prompt``/``chosen``/``rejected``, read by the same loader as a user's files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..jobs.default_assets import arithmetic_examples

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
        wrong = right + rng.choice(near_miss_offsets(right))
        pairs.append({"prompt": example["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return pairs


def near_miss_offsets(right: int) -> list[int]:
    """Every offset of a wrong answer to a question whose sum is ``right``: +-1..10, never below 0."""
    return [d for d in range(-MAX_OFFSET, MAX_OFFSET + 1) if d and right + d >= 0]


def more_near_misses(pairs: list[dict[str, str]], per_prompt: int, seed: int) -> list[dict[str, str]]:
    """Each pair followed by ``per_prompt - 1`` pairs of the same question with other wrong answers.

    Raises:
        ValueError: ``per_prompt`` is larger than the number of distinct wrong answers of a question.
    """
    rng = random.Random(seed + 2)
    result = []
    for pair in pairs:
        right, first = int(pair["chosen"]), int(pair["rejected"])
        others = [right + d for d in near_miss_offsets(right) if right + d != first]
        if per_prompt - 1 > len(others):
            raise ValueError(
                f"{pair['prompt']} has only {len(others) + 1} wrong answers within {MAX_OFFSET}; set "
                f"data.generated_rejected_per_prompt <= {len(others) + 1}."
            )
        result.append(pair)
        result.extend({**pair, "rejected": str(wrong)} for wrong in rng.sample(others, per_prompt - 1))
    return result


def write_arithmetic_pairs(
    directory: Path, *, train_size: int, val_size: int, seed: int, rejected_per_prompt: int = 1
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` (``train_size`` questions, ``rejected_per_prompt`` pairs each) and ``val.jsonl``
    (``val_size`` other questions, one pair each); returns their paths."""
    pairs = arithmetic_pairs(train_size + val_size, seed)
    train = more_near_misses(pairs[:train_size], rejected_per_prompt, seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = (directory / "train.jsonl", directory / "val.jsonl")
    for path, split in zip(paths, (train, pairs[train_size:]), strict=True):
        path.write_text("".join(json.dumps(p) + "\n" for p in split))
    return paths
