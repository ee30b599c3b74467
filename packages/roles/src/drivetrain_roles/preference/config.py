"""Config sections shared by the pairwise commands ``drivetrain dpo`` and ``drivetrain rm``.

Each command declares its own top-level dataclass (``DPOConfig``, ``RMConfig``) from these sections and
core's; loading, checking and messages are the job runtime's command config layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import ConfigError, ModelConfig

from ..command_sections import (
    BatchLoopConfig,
    Overlong,
    builtin_model,
    check_val_files_have_train_files,
)


def pairwise_model() -> ModelConfig:
    """The default ``model`` section of ``dpo`` and ``rm``: the embedded model, built without dropout (TRL's
    ``disable_dropout=True`` for DPO and reward training; ``model.disable_dropout=false`` keeps it)."""
    return dataclasses.replace(builtin_model(), disable_dropout=True)


@dataclass(kw_only=True, frozen=True)
class PairDataConfig:
    """Where the preference pairs come from and how they are tokenised.

    Attributes:
        train_files: parquet/jsonl files of pairs, dataset folders (``save_to_disk``) or Hugging Face Hub
            dataset ids (``trl-lib/ultrafeedback_binarized``); empty selects the generated arithmetic pairs (the
            correct sum chosen, a wrong one rejected).
        val_files: held-out pairs, as ``train_files``; empty with generated data uses the generated held-out
            split, empty with user files disables held-out evaluation.
        dataset_config: the config (subset) of each Hugging Face Hub dataset in ``train_files``/``val_files``
            (TRL's ``dataset_config``); ``None``: its default.
        train_split, val_split: the split read from each dataset folder or Hub dataset of ``train_files``, and of
            ``val_files`` (TRL's ``dataset_train_split``/``dataset_test_split``); files have none.
        prompt_key: column of the prompt text; with ``chat``, read only for sides that hold assistant turns
            alone (TRL's explicit prompt: a list of messages, or a text taken as one user turn).
        chosen_key, rejected_key: columns of the preferred and the dispreferred response.
        chat: the chosen/rejected columns hold chat conversations (lists of role/content messages ending with
            the assistant turn, rendered with the tokenizer's chat template) instead of response texts; their
            prompt turns are in them or in the prompt column.
        margin_key: column of a per-pair margin (a number) by which the chosen score should exceed the rejected
            one, as TRL's ``RewardTrainer`` reads a ``margin`` column (``drivetrain rm`` only); ``None``: no margin.
        max_length: token budget of one sequence (prompt + response).
        overlong: what a pair with a side longer than ``max_length`` does: ``error`` (the run refuses the data,
            naming the row) or ``drop`` (the pair is skipped, with one warning counting them).
        generated_train_size, generated_val_size: questions in the generated arithmetic splits (one pair per
            held-out question).
        generated_rejected_per_prompt: generated training pairs per question, each with a different wrong
            answer (1 to 10).
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    dataset_config: str | None = None
    train_split: str = "train"
    val_split: str = "test"
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    chat: bool = False
    margin_key: str | None = None
    max_length: int = 32
    overlong: Overlong = "error"
    generated_train_size: int = 2000
    generated_val_size: int = 200
    generated_rejected_per_prompt: int = 1

    def __post_init__(self) -> None:
        check_val_files_have_train_files(self.train_files, self.val_files)
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2 tokens, got {self.max_length}.")
        if self.generated_train_size < 1 or self.generated_val_size < 0:
            raise ConfigError("data.generated_train_size must be >= 1 and data.generated_val_size >= 0.")
        if not 1 <= self.generated_rejected_per_prompt <= 10:
            raise ConfigError(
                "data.generated_rejected_per_prompt must be between 1 and 10 (a sum has at least 10 wrong answers "
                f"within 10 of it), got {self.generated_rejected_per_prompt}."
            )

    @property
    def generated(self) -> bool:
        """Whether the run uses the generated arithmetic pairs."""
        return not self.train_files


@dataclass(kw_only=True, frozen=True)
class WarmStartConfig:
    """A short ``drivetrain sft`` run on the prompts and chosen responses before the pairwise training.

    Preference training starts from a model that already answers in the task's format (DPO and reward models
    are usually trained from an SFT checkpoint). The warm start is a full SFT run folder under
    ``<run>/warm_start``; its ``final_model`` is where the pairwise training starts.

    Attributes:
        sft_steps: SFT steps; 0 starts from ``model.path`` as it is. Unless set, only the embedded
            ``builtin:arithmetic`` model warms up (an untrained model); any other model starts as it is
            (usually an SFT or instruct model already, which a full fine-tune at ``lr`` would overwrite).
        batch_size: SFT sequences per step.
        lr: SFT learning rate (cosine schedule over ``sft_steps``).
    """

    sft_steps: int = 800
    batch_size: int = 64
    lr: float = 5e-3

    def __post_init__(self) -> None:
        if self.sft_steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ConfigError(
                f"warm_start needs sft_steps >= 0, batch_size >= 1 and lr > 0, got {self.sft_steps}, "
                f"{self.batch_size}, {self.lr}."
            )


USER_MODEL_WARM_START: dict[str, dict[str, Any]] = {"warm_start": {"sft_steps": 0}}
"""The ``user-model`` preset's warm start: none for any model but an embedded one (GRPO's rule too).

NOTE: a user's model (a TRL user's instruct model) went through the embedded job's SFT warm start, a full
fine-tune at lr 5e-3, before DPO, and the DPO reference became that model."""


@dataclass(kw_only=True, frozen=True)
class PairTrainerConfig(BatchLoopConfig):
    """The pairwise training loop; fields and checks every command shares come from :class:`BatchLoopConfig`.

    Attributes:
        batch_size: pairs per optimizer step over all data-parallel ranks (divisible by their number); the
            chosen and rejected sequence of a pair always share a micro-batch and a rank.
        eval_samples: held-out prompts answered greedily for the exact-match accuracy (``dpo``).
    """

    total_steps: int = 150
    batch_size: int = 32
    eval_every: int = 50
    save_every: int = 0
