"""Typed configuration of ``drivetrain grpo``: the whole config, its defaults (the embedded job) and presets.

Loading is the job runtime's command config layer (:mod:`drivetrain_roles.runtime.command_config`). The defaults are the
embedded job: the arithmetic model of ``drivetrain sft``, warmed up by a short SFT run to a policy that is sometimes
right (10-23% held-out accuracy), then trained by GRPO with an exact-answer reward.

GRPO's own section is ``algorithm_config``; the sections and checks it shares with ``ppo`` live in
:mod:`drivetrain_roles.rl` (``rollout_config``, ``trainer_config``, ``job_config``); their names are re-exported
here, where users import them from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from drivetrain_engine_core.backend import EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import CheckpointConfig

from ..command_sections import (
    USER_MODEL_MAX_NEW_TOKENS,
    DataConfig,
    RunOptimizerConfig,
    builtin_model,
    model_presets,
)
from ..reward_model.config import RewardModelConfig
from ..rl.environment_config import EnvironmentConfig
from ..rl.job_config import (
    POLICY_WARMUP_STEPS,
    USER_MODEL_LR,
    PolicyJobConfig,
    RolloutJobConfig,
    check_mini_batch_share,
    check_reward_source,
    check_sections,
)

# NOTE: the shared defaults keep their private names here, as GRPOConfig's (API-checked) signature shows them.
from ..rl.job_config import default_checkpoint as _default_checkpoint
from ..rl.job_config import default_engine as _default_engine
from ..rl.rollout_config import RolloutConfig
from ..rl.trainer_config import TRAINER_MODES, TrainerConfig, choose_mode, generation_lag
from ..runtime.command_config.presets import Preset, PresetChoice
from .algorithm_config import DEFAULT_ROLLOUT_IS_CAP, AlgorithmConfig

OFF_POLICY = Preset("off-policy", {"algorithm": {"rollout_is_cap": DEFAULT_ROLLOUT_IS_CAP}})
"""What ``trainer.mode`` other than ``sync`` sets: its older samples are corrected (``algorithm.rollout_is_cap``)."""


def _default_optimizer() -> RunOptimizerConfig:
    return RunOptimizerConfig(lr=2e-4, weight_decay=0.0, clip_grad=1.0, lr_schedule="constant")


@dataclass(kw_only=True, frozen=True)
class GRPOConfig:
    """Everything one GRPO run needs; the defaults are the embedded arithmetic job.

    Attributes:
        model: the policy to train: an embedded model (``builtin:arithmetic``, ``builtin:multistep``: warm-started by
            SFT), or a model directory such as
            the ``final_model`` of a ``drivetrain sft`` run.
        engine: the actor's (and reference's) engine config.
        optimizer: the actor's AdamW and LR schedule; ``total_steps`` follows ``trainer.total_steps`` (the schedule
            steps once per policy update) and ``warmup_steps`` is 10, unless set.
        checkpoint: checkpoint contents and retention.
        data: prompts (``data.prompt_key``) and their reference answers (``data.response_key``), which the
            reward function reads (``algorithm.reward_function``).
        rollout: sampling and the weight hand-off.
        algorithm: the GRPO objective.
        trainer: the loop.
        reward_model: how the reward models in ``algorithm.reward_functions`` run (each on its own engine).
        environment: a multi-turn environment to act in (none: one response per prompt).
    """

    model: ModelConfig = field(default_factory=builtin_model)
    engine: EngineConfig = field(default_factory=_default_engine)
    optimizer: RunOptimizerConfig = field(default_factory=_default_optimizer)
    checkpoint: CheckpointConfig = field(default_factory=_default_checkpoint)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    presets: ClassVar[tuple[PresetChoice, ...]] = (
        # Another model than the embedded one trains at lr 1e-6 (verl's actor, TRL's GRPO), on examples of up to
        # 1024 tokens, with responses of up to 256 (TRL's max_completion_length).
        model_presets(
            "grpo",
            {"optimizer": {"lr": USER_MODEL_LR}, "rollout": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS}},
        ),
        PresetChoice(
            key="trainer.mode", presets={mode: OFF_POLICY for mode in TRAINER_MODES if mode != "sync"}
        ),
    )

    def __post_init__(self) -> None:
        check_sections(self, self.algorithm.overlong_buffer_len, self.algorithm.ppo_mini_batches)
        check_reward_source(self)
        self.run_optimizer()  # core's optimizer checks, with the run's length

    def run_optimizer(self) -> OptimizerConfig:
        """The actor's optimizer as its engine gets it: the schedule spans ``trainer.total_steps`` unless set."""
        return self.optimizer.for_run(self.trainer.total_steps, POLICY_WARMUP_STEPS)


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> GRPOConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown key or an invalid value.
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(GRPOConfig, config_file, overrides)


__all__ = [
    "DEFAULT_ROLLOUT_IS_CAP",
    "TRAINER_MODES",
    "USER_MODEL_LR",
    "AlgorithmConfig",
    "GRPOConfig",
    "PolicyJobConfig",
    "RolloutConfig",
    "RolloutJobConfig",
    "TrainerConfig",
    "check_mini_batch_share",
    "check_sections",
    "choose_mode",
    "generation_lag",
    "load_config",
]
