"""What ``trl_comparison.py`` compares: the cases (each command's defaults on the embedded task, and a
realistic SFT case) in drivetrain's overrides and the TRL worker's terms, and the realistic case's assets."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHARED = (
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "trainer.progress_bar=false",
    "trainer.eval_samples=200",
)
CASE_KEYS = ("sft", "dpo", "grpo", "realistic")
"""What ``--only`` selects: a case's first word, ``realistic`` for the realistic SFT case."""


@dataclass(frozen=True)
class Case:
    """One comparison: the drivetrain command and overrides, and the same settings in the TRL worker's terms."""

    name: str
    command: str
    steps: tuple[int, int]
    overrides: tuple[str, ...]
    trl: dict[str, Any]
    trl_variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"trl": {}})
    start_model: str = "initial_model"  # under drivetrain's run folder: what TRL starts from

    @property
    def key(self) -> str:
        """The case's name in ``--only``: its first word, or ``realistic``."""
        return "realistic" if "realistic" in self.name else self.name.split()[0]


def cases(quick: bool) -> list[Case]:
    """The tiny embedded task (``sft``, ``dpo``, ``grpo`` at their defaults) and the realistic SFT case."""
    scale = (
        (lambda short, long: (short, long))
        if not quick
        else (lambda short, long: (short, short + (long - short) // 4))
    )
    # TRL's SFT padded and padding-free; --quick runs only the padded one, the faster in every run so far.
    sft_variants = {"trl (padded)": {}, **({} if quick else {"trl (padding-free)": {"padding_free": True}})}
    return [
        Case(
            "sft",
            "sft",
            scale(20, 420),
            (),
            {"kind": "sft", "batch": 64, "lr": 3e-3, "warmup": 10},
            sft_variants,
        ),
        Case(
            "dpo",
            "dpo",
            scale(20, 420),
            (),
            {"kind": "dpo", "batch": 32, "lr": 1e-4, "warmup": 0, "beta": 0.5},
            start_model="warm_start/final_model",
        ),
        Case(
            "grpo",
            "grpo",
            scale(4, 84),
            # TRL's side makes 2 optimizer steps per generation (mini_batches below); the embedded job's default
            # is 4 since the model's heads became 32 wide, so drivetrain is held to TRL's 2 here.
            ("algorithm.ppo_mini_batches=2",),
            {
                "kind": "grpo",
                "prompts": 32,
                "n": 8,
                "mini_batches": 2,
                "lr": 2e-4,
                "warmup": 10,
                "beta": 0.001,
                "max_new_tokens": 6,
            },
            start_model="warm_start/final_model",
        ),
        Case(
            "sft realistic (4.3M params, ~8k tokens/step)",
            "sft",
            # --quick: 1 vs 3 steps (the realistic runs were most of the full run's time: TRL's take 15-25 CPU-s
            # a step); two marginal steps against start-ups of 30-90 s, so read its quick figure as rough.
            (1, 3) if quick else (3, 23),
            (
                "optimizer.lr=3e-4",
                "engine.micro_batch.max_tokens=8192",
                "trainer.batch_size=64",
                "data.max_length=512",
                "trainer.eval_samples=20",
            ),
            {"kind": "sft", "batch": 64, "lr": 3e-4, "warmup": 0},
            sft_variants,
        ),
    ]


def realistic_assets(root: Path) -> tuple[str, ...]:
    """A 4-layer, 256-wide Qwen2 (about 4.3 M parameters) with the arithmetic tokenizer, and long sums
    (``"12+7+...="``, 60 to 400 tokens, long-tailed) of which 64 make about 8k tokens (measured: 3.6-4.2k per 32): the overrides that point
    ``drivetrain sft`` at them (warm-up 0: the schedule is a user model's)."""
    import random

    import torch
    from drivetrain_roles.jobs.default_assets import build_arithmetic_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_arithmetic_tokenizer()
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model_dir = root / "realistic_model"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)

    def row() -> str:
        terms = [rng.randint(1, 99) for _ in range(min(130, int(rng.paretovariate(1.5) * 20)))]
        return json.dumps({"prompt": "+".join(map(str, terms)) + "=", "response": str(sum(terms))})

    (root / "data").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 2000), ("val", 20)):
        (root / "data" / f"{split}.jsonl").write_text("\n".join(row() for _ in range(count)) + "\n")
    return (
        f"model.path={model_dir}",
        f"data.train_files=[{root / 'data' / 'train.jsonl'}]",
        f"data.val_files=[{root / 'data' / 'val.jsonl'}]",
        "optimizer.warmup_steps=0",
    )
