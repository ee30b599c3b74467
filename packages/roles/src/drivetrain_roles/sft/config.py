"""Typed configuration of ``drivetrain sft``: its sections, their defaults (the embedded job) and derived values.

Loading (YAML + dotted overrides, type checks, messages) is the job runtime's command config layer
(:mod:`drivetrain_roles.runtime.command_config`); this module only declares what the SFT command configures.
The ``engine`` section is built by the chosen backend's own config class, so backend knobs
(``engine.ulysses_sequence_parallel_size``) are checked too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from drivetrain_engine_core.config import (
    CheckpointConfig,
    ConfigError,
    EngineConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
)

from ..command_sections import (
    USER_MODEL_MAX_NEW_TOKENS,
    BatchLoopConfig,
    Overlong,
    builtin_model,
    check_val_files_have_train_files,
    for_a_user_model,
    merged_sections,
)
from ..losses.aggregation import AGGREGATION_MODES

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the examples come from and how they are tokenised.

    Attributes:
        train_files: parquet/jsonl files; empty selects the generated arithmetic data set.
        val_files: held-out files; empty with generated data uses the generated held-out split, empty with
            user files disables held-out evaluation.
        prompt_key, response_key: columns of prompt/response pairs (loss on the response).
        messages_key: column of chat messages (rendered with the tokenizer's chat template; loss on the assistant
            turns that ``assistant_turns`` picks); when set, prompt/response columns are not read.
        assistant_turns: which assistant turns of chat messages carry loss: ``all`` (verl's multi-turn SFT
            dataset, TRL's ``assistant_only_loss``) or ``last`` (the final one, as a prompt/response pair).
        apply_chat_template: render each prompt/response pair as a user turn and an assistant turn with the
            tokenizer's chat template (what verl's SFT dataset and RL prompts do with a prompt column; for an
            instruct model); off, the prompt is ``tokenizer(prompt)`` as written (TRL's prompt/completion).
        max_length: token budget of one example (prompt + response).
        overlong: what an example longer than ``max_length`` does: ``error`` (the run refuses the data, naming
            the row) or ``drop`` (skipped with one warning counting them, as OpenRLHF filters them; a cut
            response would train on text that never ends).
        generated_train_size, generated_val_size: sizes of the generated arithmetic splits.
    """

    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str | None = None
    assistant_turns: Literal["all", "last"] = "all"
    apply_chat_template: bool = False
    max_length: int = 32
    overlong: Overlong = "error"
    generated_train_size: int = 2000
    generated_val_size: int = 200

    def __post_init__(self) -> None:
        check_val_files_have_train_files(self.train_files, self.val_files)
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2 tokens, got {self.max_length}.")
        if self.apply_chat_template and self.messages_key is not None:
            raise ConfigError(
                "data.apply_chat_template renders prompt/response columns, but data.messages_key reads chat "
                "messages (always rendered with the chat template); set one of them."
            )
        if self.generated_train_size < 1 or self.generated_val_size < 0:
            raise ConfigError("data.generated_train_size must be >= 1 and data.generated_val_size >= 0.")

    @property
    def generated(self) -> bool:
        """Whether the run uses the generated arithmetic data set."""
        return not self.train_files


@dataclass(kw_only=True, frozen=True)
class TrainerConfig(BatchLoopConfig):
    """The training loop; the fields and checks every command shares come from :class:`BatchLoopConfig`.

    Attributes:
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.
    """

    total_steps: int = 800
    batch_size: int = 64
    eval_every: int = 100
    save_every: int = 200
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_agg_mode not in AGGREGATION_MODES:
            raise ConfigError(
                f"trainer.loss_agg_mode={self.loss_agg_mode!r} is not supported; choose one of {list(AGGREGATION_MODES)}."
            )


def schedule_length(total_steps: int) -> dict[str, int]:
    """The LR schedule of a run of ``total_steps``: it spans the run; warm-up is a tenth, at most 10 steps."""
    return {"total_steps": total_steps, "warmup_steps": min(10, total_steps // 10)}


SFT_DIST_TIMEOUT_S = 300.0
"""The command's collective timeout: every collective of an SFT step should be quick (a save, the slowest,
takes seconds to a minute), so a rank stuck for five minutes is named (``<run>/heartbeat``) rather than
waited on for the engine's default ten."""


def _default_engine() -> EngineConfig:
    return EngineConfig(
        micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=2048),
        dist_timeout_s=SFT_DIST_TIMEOUT_S,
    )


USER_MODEL_LR = 1e-5
"""The SFT learning rate of any model but the embedded one (verl's SFT trainer default; TRL's is 2e-5)."""


def _default_optimizer() -> OptimizerConfig:
    schedule = schedule_length(TrainerConfig().total_steps)
    return OptimizerConfig(
        lr=3e-3,
        weight_decay=0.0,
        lr_schedule="cosine",
        min_lr_ratio=0.1,
        clip_grad=1.0,
        total_steps=schedule["total_steps"],
        warmup_steps=schedule["warmup_steps"],
    )


def _default_checkpoint() -> CheckpointConfig:
    return CheckpointConfig(max_ckpt_to_keep=2)


@dataclass(kw_only=True, frozen=True)
class SFTConfig:
    """Everything one SFT run needs; the defaults are the embedded arithmetic job (see :func:`load_config`).

    Attributes:
        model: the model (core ``ModelConfig``); ``builtin:arithmetic`` is the embedded tiny model.
        engine: the backend's engine config (``engine.backend`` picks the installed plugin).
        optimizer: AdamW and its LR schedule; ``total_steps`` and ``warmup_steps`` follow
            ``trainer.total_steps`` unless set (see :func:`schedule_length`).
        checkpoint: checkpoint contents and retention.
        data: training and held-out data.
        trainer: the training loop.
    """

    model: ModelConfig = field(default_factory=builtin_model)
    engine: EngineConfig = field(default_factory=_default_engine)
    optimizer: OptimizerConfig = field(default_factory=_default_optimizer)
    checkpoint: CheckpointConfig = field(default_factory=_default_checkpoint)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @staticmethod
    def derived_values(config: DictConfig) -> dict[str, Any]:
        """Values that follow others unless the user sets them: the LR schedule follows the run length; another
        model than the embedded one trains at lr 1e-5 (verl's SFT default) on examples of up to 1024 tokens, and
        its evaluation generates up to 256."""
        return merged_sections(
            {"optimizer": schedule_length(config.trainer.total_steps)},
            for_a_user_model(
                config,
                {
                    "optimizer": {"lr": USER_MODEL_LR},
                    "trainer": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS},
                },
            ),
        )


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown section or key, or an invalid value
            (the message names the field and the fix).
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(SFTConfig, config_file, overrides)
