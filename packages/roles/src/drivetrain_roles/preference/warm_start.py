"""The SFT warm start of a pairwise run: ``drivetrain sft`` on the chosen responses, in ``<run>/warm_start``.

A resumed pairwise run reuses the warm start its first part finished: its checkpoints and its reference
were made from that ``final_model``.
"""

from __future__ import annotations

import dataclasses

from drivetrain_engine_core.backend import EngineConfig, ModelConfig
from drivetrain_engine_core.job import CheckpointConfig

from ..command_sections import DataConfig, RunOptimizerConfig
from ..sft.config import SFTConfig, warm_start_trainer
from .config import PairDataConfig, PairTrainerConfig, WarmStartConfig


def warm_start_config(
    *,
    model: ModelConfig,
    engine: EngineConfig,
    warm_start: WarmStartConfig,
    data: PairDataConfig,
    trainer: PairTrainerConfig,
    sft_files: tuple[list[str], list[str]],
) -> SFTConfig:
    """The SFT run of the warm start: the pairwise run's model and engine, its own steps and learning rate."""
    return SFTConfig(
        model=dataclasses.replace(model, model_type="language_model"),
        engine=engine,
        optimizer=RunOptimizerConfig(
            lr=warm_start.lr, weight_decay=0.0, lr_schedule="cosine", min_lr_ratio=0.1, clip_grad=1.0
        ),
        checkpoint=CheckpointConfig(max_ckpt_to_keep=1),
        data=DataConfig(
            train_files=tuple(sft_files[0]),
            val_files=tuple(sft_files[1]),
            messages_key="messages" if data.chat else None,
            max_length=data.max_length,
            overlong=data.overlong,
        ),
        trainer=warm_start_trainer(
            trainer,
            steps=warm_start.sft_steps,
            batch_size=warm_start.batch_size,
            max_new_tokens=trainer.max_new_tokens,
        ),
    )
