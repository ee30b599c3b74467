"""Typed configuration of ``drivetrain sft``: its sections, their defaults (the embedded job) and presets.

Loading (YAML + dotted overrides, type checks, messages) is the job runtime's command config layer
(:mod:`drivetrain_roles.runtime.command_config`); this module only declares what the SFT command configures.
The ``engine`` section is built by the chosen backend's own config class, so backend knobs
(``engine.ulysses_sequence_parallel_size``) are checked too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from drivetrain_engine_core.backend import ConfigError, EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import CheckpointConfig, MicroBatchConfig

from ..command_sections import (
    USER_MODEL_MAX_NEW_TOKENS,
    BatchLoopConfig,
    DataConfig,
    LoopConfig,
    RunOptimizerConfig,
    builtin_model,
    model_presets,
)
from ..losses.names import AGGREGATION_MODES
from ..runtime.command_config.presets import PresetChoice


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


def warm_start_trainer(run: LoopConfig, *, steps: int, batch_size: int, max_new_tokens: int) -> TrainerConfig:
    """The ``trainer`` section of a warm start, the SFT run a ``dpo``, ``rm`` or ``grpo`` run starts from: its
    own ``steps``, ``batch_size`` and ``max_new_tokens``, evaluated before and after and saved only at its end,
    and the calling run's ``trainer`` values (``run``) for the rest: held-out answers, seed, progress bar, CPU
    threads, trackers, divergence guard."""
    return TrainerConfig(
        total_steps=steps,
        batch_size=batch_size,
        eval_every=0,
        save_every=0,
        eval_samples=run.eval_samples,
        max_new_tokens=max_new_tokens,
        seed=run.seed,
        progress_bar=run.progress_bar,
        cpu_threads=run.cpu_threads,
        report_to=run.report_to,
        divergence=run.divergence,
    )


def sft_warmup_steps(total_steps: int) -> int:
    """The warm-up of an SFT run of ``total_steps`` unless set: a tenth of the run, at most 10 steps."""
    return min(10, total_steps // 10)


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


def _default_optimizer() -> RunOptimizerConfig:
    return RunOptimizerConfig(
        lr=3e-3, weight_decay=0.0, lr_schedule="cosine", min_lr_ratio=0.1, clip_grad=1.0
    )


def _default_checkpoint() -> CheckpointConfig:
    return CheckpointConfig(max_ckpt_to_keep=2)


@dataclass(kw_only=True, frozen=True)
class SFTConfig:
    """Everything one SFT run needs; the defaults are the embedded arithmetic job (see :func:`load_config`).

    Attributes:
        model: the model (core ``ModelConfig``); ``builtin:arithmetic`` and ``builtin:multistep`` are the embedded
            tiny models of their tasks.
        engine: the backend's engine config (``engine.backend`` picks the installed plugin).
        optimizer: AdamW and its LR schedule; ``total_steps`` and ``warmup_steps`` follow
            ``trainer.total_steps`` unless set (see :func:`sft_warmup_steps`).
        checkpoint: checkpoint contents and retention.
        data: training and held-out data.
        trainer: the training loop.
    """

    model: ModelConfig = field(default_factory=builtin_model)
    engine: EngineConfig = field(default_factory=_default_engine)
    optimizer: RunOptimizerConfig = field(default_factory=_default_optimizer)
    checkpoint: CheckpointConfig = field(default_factory=_default_checkpoint)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    presets: ClassVar[tuple[PresetChoice, ...]] = (
        # Another model than the embedded one trains at lr 1e-5 (verl's SFT default) on examples of up to 1024
        # tokens, and its evaluation generates up to 256.
        model_presets(
            "sft",
            {"optimizer": {"lr": USER_MODEL_LR}, "trainer": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS}},
        ),
    )

    def __post_init__(self) -> None:
        if self.data.response_key is None:
            raise ConfigError(
                "data.response_key=null (rows without a response) is for grpo and ppo prompts; SFT trains on the "
                "responses: set data.response_key to the column that holds them."
            )
        self.run_optimizer()  # core's optimizer checks, with the run's length

    def run_optimizer(self) -> OptimizerConfig:
        """The optimizer the run's engine gets: the schedule spans ``trainer.total_steps`` unless set."""
        steps = self.trainer.total_steps
        return self.optimizer.for_run(steps, sft_warmup_steps(steps))


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown section or key, or an invalid value
            (the message names the field and the fix).
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(SFTConfig, config_file, overrides)
