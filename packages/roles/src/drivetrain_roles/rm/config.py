"""Typed configuration of ``drivetrain rm``: its sections and defaults (the embedded arithmetic job).

The defaults run offline: an SFT warm start of the embedded tiny model on the generated arithmetic questions,
then a Bradley-Terry reward model (a value head on that model) on pairs of the correct sum and a near miss.
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
    RunOptimizerConfig,
    model_presets,
)
from ..losses.config import RewardLossConfig
from ..preference.config import (
    USER_MODEL_WARM_START,
    PairDataConfig,
    PairTrainerConfig,
    WarmStartConfig,
    pairwise_model,
)
from ..runtime.command_config.presets import PresetChoice

WARMUP_STEPS = 200
"""Linear LR warm-up of the reward-model steps, at most a fifth of them, unless set (measured with lr 2e-3;
the head starts random)."""
USER_MODEL_LR = 1e-5
"""The reward-model learning rate of any model but the embedded one (TRL's and OpenRLHF's examples)."""


def _default_engine() -> EngineConfig:
    return EngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=2048))


def _default_optimizer() -> RunOptimizerConfig:
    return RunOptimizerConfig(
        lr=2e-3, weight_decay=0.0, lr_schedule="cosine", min_lr_ratio=0.1, clip_grad=1.0
    )


def _default_trainer() -> PairTrainerConfig:
    return PairTrainerConfig(total_steps=1500, eval_every=500)


def _default_data() -> PairDataConfig:
    # Eight different near misses per training question (not one fixed one, which the model memorises), and
    # 400 held-out questions so the held-out accuracy is good to about +-1 point.
    return PairDataConfig(generated_val_size=400, generated_rejected_per_prompt=8)


@dataclass(kw_only=True, frozen=True)
class RMConfig:
    """Everything one reward-model run needs; the defaults are the embedded arithmetic job.

    Attributes:
        model: the starting model (``builtin:arithmetic`` is the embedded tiny model); a value head is added
            on top of it (``model.model_type`` is set to ``value_model`` for the reward model).
        engine: the backend's engine config.
        optimizer: AdamW and its LR schedule for the reward-model steps (it spans ``trainer.total_steps`` and
            warms up for 200 of them, at most a fifth, unless set).
        checkpoint: checkpoint contents and retention.
        data: preference pairs.
        warm_start: the SFT run before reward modelling (``warm_start.sft_steps=0`` starts from ``model.path``).
        trainer: the reward-model loop.
        rm: the loss (reward centring).
    """

    model: ModelConfig = field(default_factory=pairwise_model)
    engine: EngineConfig = field(default_factory=_default_engine)
    optimizer: RunOptimizerConfig = field(default_factory=_default_optimizer)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(max_ckpt_to_keep=1))
    data: PairDataConfig = field(default_factory=_default_data)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: PairTrainerConfig = field(default_factory=_default_trainer)
    rm: RewardLossConfig = field(default_factory=RewardLossConfig)

    presets: ClassVar[tuple[PresetChoice, ...]] = (
        # Only the embedded model has an SFT warm start; another model trains at lr 1e-5 on sequences of up to
        # 1024 tokens.
        model_presets(
            "rm",
            {
                **USER_MODEL_WARM_START,
                "optimizer": {"lr": USER_MODEL_LR},
                "trainer": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS},
            },
        ),
    )

    def __post_init__(self) -> None:
        if self.trainer.eval_metrics:
            raise ConfigError(
                f"trainer.eval_metrics={list(self.trainer.eval_metrics)}: a reward model generates no answers to "
                "measure; its held-out measures are the pairwise accuracy and margin. Leave eval_metrics unset."
            )
        self.run_optimizer()  # core's optimizer checks, with the run's length

    def run_optimizer(self) -> OptimizerConfig:
        """The optimizer the run's engine gets: the schedule spans ``trainer.total_steps`` unless set."""
        steps = self.trainer.total_steps
        return self.optimizer.for_run(steps, warmup_steps=min(WARMUP_STEPS, steps // 5))


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> RMConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: an unknown key or an invalid value (the message names the field and the fix).
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(RMConfig, config_file, overrides)
