"""Typed configuration of ``drivetrain dpo``: its sections and defaults (the embedded arithmetic job).

The defaults run offline: an SFT warm start of the embedded tiny model on the generated arithmetic questions
(``warm_start``), then DPO on pairs of the correct sum (chosen) and a near miss (rejected).
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
from ..losses.config import DPOLossConfig
from ..preference.config import (
    USER_MODEL_WARM_START,
    PairDataConfig,
    PairTrainerConfig,
    WarmStartConfig,
    pairwise_model,
)
from ..runtime.command_config.presets import PresetChoice

REFERENCE_MODES: tuple[str, ...] = ("precomputed", "engine", "lora_base")


@dataclass(kw_only=True, frozen=True)
class DPOSection(DPOLossConfig):
    """The DPO objective and where the reference log-probs come from.

    Attributes:
        reference: ``precomputed`` (the starting model scores every pair once before training, no second
            model is kept), ``engine`` (a frozen copy in its own inference engine scores each step's pairs) or
            ``lora_base`` (the actor with its LoRA adapters disabled; needs ``model.lora``).
    """

    reference: str = "precomputed"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reference not in REFERENCE_MODES:
            raise ConfigError(
                f"dpo.reference={self.reference!r} is not supported; choose one of {list(REFERENCE_MODES)}."
            )


def _default_engine() -> EngineConfig:
    return EngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=2048))


USER_MODEL_LR = 1e-6
"""The DPO learning rate of any model but the embedded one (TRL's ``DPOConfig`` default)."""
USER_MODEL_BETA = 0.1
"""The DPO beta of any model but the embedded one (TRL's default)."""


def _default_optimizer() -> RunOptimizerConfig:
    return RunOptimizerConfig(lr=1e-4, weight_decay=0.0, lr_schedule="constant", clip_grad=1.0)


def _default_trainer() -> PairTrainerConfig:
    return PairTrainerConfig(total_steps=300, eval_every=100)


def _default_dpo() -> DPOSection:
    # A larger beta than TRL's 0.1 keeps the tiny embedded model close to its SFT start: with beta=0.1 (or
    # lr=1e-3) DPO wins preference accuracy but lowers the chosen answers' log-probs and greedy accuracy.
    return DPOSection(beta=0.5)


@dataclass(kw_only=True, frozen=True)
class DPOConfig:
    """Everything one DPO run needs; the defaults are the embedded arithmetic job.

    Attributes:
        model: the starting model (``builtin:arithmetic`` is the embedded tiny model); the SFT warm start,
            if any, starts from it.
        engine: the backend's engine config.
        optimizer: AdamW and its LR schedule for the DPO steps (it spans ``trainer.total_steps`` and does not
            warm up, unless set).
        checkpoint: checkpoint contents and retention.
        data: preference pairs.
        warm_start: the SFT run before DPO (``warm_start.sft_steps=0`` starts DPO from ``model.path``).
        trainer: the DPO loop.
        dpo: the loss and the reference.
    """

    model: ModelConfig = field(default_factory=pairwise_model)
    engine: EngineConfig = field(default_factory=_default_engine)
    optimizer: RunOptimizerConfig = field(default_factory=_default_optimizer)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(max_ckpt_to_keep=1))
    data: PairDataConfig = field(default_factory=PairDataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    trainer: PairTrainerConfig = field(default_factory=_default_trainer)
    dpo: DPOSection = field(default_factory=_default_dpo)

    def __post_init__(self) -> None:
        if self.dpo.reference == "lora_base" and self.model.lora is None and not self.dpo.reference_free:
            raise ConfigError(
                "dpo.reference=lora_base scores the reference with the policy's LoRA adapters disabled, and "
                "model.lora is unset (the full model trains, so there is no base to fall back to). Set model.lora "
                "(e.g. model.lora.rank=16), or choose dpo.reference=precomputed or engine."
            )
        if self.data.margin_key is not None:
            raise ConfigError(
                f"data.margin_key={self.data.margin_key!r} is a reward-model option (TRL's RewardTrainer margin); "
                "DPO has no margin: drop it, or train a reward model with drivetrain rm."
            )
        self.run_optimizer()  # core's optimizer checks, with the run's length

    def run_optimizer(self) -> OptimizerConfig:
        """The optimizer the run's engine gets: the schedule spans ``trainer.total_steps`` unless set."""
        return self.optimizer.for_run(self.trainer.total_steps, warmup_steps=0)

    presets: ClassVar[tuple[PresetChoice, ...]] = (
        # Only the embedded model warms up; another model trains at TRL's DPOConfig defaults (lr 1e-6, beta 0.1,
        # 1024 tokens; 256 generated at evaluation).
        model_presets(
            "dpo",
            {
                **USER_MODEL_WARM_START,
                "optimizer": {"lr": USER_MODEL_LR},
                "dpo": {"beta": USER_MODEL_BETA},
                "trainer": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS},
            },
        ),
    )


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> DPOConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: an unknown key or an invalid value (the message names the field and the fix).
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(DPOConfig, config_file, overrides)
