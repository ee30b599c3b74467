"""What a command that samples from its policy and trains it (``grpo``, ``ppo``) shares: the sections the warm
start, the sampling and the update read (as protocols), their shared defaults, and the checks across those
sections."""

from __future__ import annotations

from typing import Protocol

from drivetrain_engine_core.backend import ConfigError, EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import CheckpointConfig, MicroBatchConfig

from ..command_sections import DataConfig
from ..jobs.builtin_tasks import builtin_task
from .algorithm_section import AlgorithmSection
from .environment_config import EnvironmentConfig
from .rollout_config import RolloutConfig
from .trainer_config import TrainerConfig

USER_MODEL_LR = 1e-6
"""The policy's learning rate for any model but the embedded one (verl's actor default, TRL's ``GRPOConfig``)."""

POLICY_WARMUP_STEPS = 10
"""The policy's LR warm-up of ``grpo`` and ``ppo`` unless ``optimizer.warmup_steps`` is set."""


def default_engine() -> EngineConfig:
    """The engine section of ``grpo`` and ``ppo``: micro-batches cut by a budget of 4096 tokens."""
    return EngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=4096))


def default_checkpoint() -> CheckpointConfig:
    """The checkpoint section of ``grpo`` and ``ppo``: the last two steps kept."""
    return CheckpointConfig(max_ckpt_to_keep=2)


class RolloutJobConfig(Protocol):
    """The sections a command that samples from its policy shares with ``drivetrain grpo`` (``grpo``, ``ppo``):
    what the warm start, the sampling and the rollout-length check read."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def engine(self) -> EngineConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def trainer(self) -> TrainerConfig: ...
    @property
    def environment(self) -> EnvironmentConfig: ...


class PolicyJobConfig(RolloutJobConfig, Protocol):
    """A :class:`RolloutJobConfig` with the sections that train the policy: optimizer, checkpoint, algorithm."""

    @property
    def optimizer(self) -> OptimizerConfig: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...
    @property
    def algorithm(self) -> AlgorithmSection: ...
    def run_optimizer(self) -> OptimizerConfig:
        """The policy's optimizer as its engine gets it: the schedule's length is the run's unless set."""
        ...


def check_sections(config: RolloutJobConfig, overlong_buffer_len: int, ppo_mini_batches: int) -> None:
    """The checks across the sections of a command that samples from its policy (``grpo``, ``ppo``): the embedded
    model's warm start, the overlong buffer within a response, no router replay with an environment, mini-batches that divide a step's sequences.

    Raises:
        ConfigError: naming the settings and the fix.
    """
    if builtin_task(config.model.path) is not None and config.trainer.warm_start_steps < 1:
        # NOTE: 0 ran one step anyway (the embedded model is made by its warm start).
        raise ConfigError(
            f"trainer.warm_start_steps=0 with model.path={config.model.path}: the embedded model is the output of its "
            f"SFT warm start, so it needs at least 1 step ({type(config.trainer)().warm_start_steps} by default). Set "
            "trainer.warm_start_steps >= 1, or give model.path (a drivetrain sft run's final_model), which starts as is."
        )
    if config.rollout.lora_handoff == "adapter" and config.model.lora is None:
        raise ConfigError(
            "rollout.lora_handoff=adapter hands off the LoRA adapters alone, and model.lora is unset (the full "
            "model trains); set model.lora (e.g. model.lora.rank=8) or rollout.lora_handoff=merged."
        )
    buffer, longest = overlong_buffer_len, config.rollout.max_new_tokens
    if buffer >= longest:
        raise ConfigError(
            f"algorithm.overlong_buffer_len={buffer} must be below rollout.max_new_tokens={longest} (the penalty "
            f"starts {buffer} tokens before the longest response); lower it, or raise rollout.max_new_tokens."
        )
    if config.environment.enabled and config.rollout.records_routes:
        raise ConfigError(
            f"environment.name={config.environment.name} with rollout.router_replay=R3: multi-turn episodes do not "
            "record routed experts (each turn is its own generate call); set rollout.router_replay=disabled."
        )
    sequences = config.trainer.prompts_per_step * config.rollout.n
    if sequences % ppo_mini_batches:
        # NOTE: mini-batches of ceil(sequences / k) made fewer than k optimizer steps (9 sequences, k=4: 3).
        raise ConfigError(
            f"algorithm.ppo_mini_batches={ppo_mini_batches} must divide the sequences of a "
            f"step, trainer.prompts_per_step x rollout.n = {config.trainer.prompts_per_step} x {config.rollout.n} "
            f"= {sequences}, so that each of its optimizer steps takes as many; choose a divisor of {sequences}."
        )


def check_reward_source(config: PolicyJobConfig) -> None:
    """A job without reward functions (``algorithm.reward_functions=[]``) is paid by its environment alone.

    Raises:
        ConfigError: no reward functions and no environment (``environment.name``): nothing would pay a response.
    """
    if not config.algorithm.rewards().functions and not config.environment.enabled:
        raise ConfigError(
            "algorithm.reward_functions=[] lists no reward function, and without an environment (environment.name) "
            "nothing else pays a response; list at least one, e.g. algorithm.reward_functions=[exact_match], or "
            "set environment.name (its episodes are then paid by the environment's reward alone)."
        )


def check_mini_batch_share(config: PolicyJobConfig, world_size: int) -> None:
    """Every data-parallel rank's share of a step must fill each of the update's mini-batches; checked on every
    rank before the warm start (the update refused it after the warm start and a rollout).

    Raises:
        ConfigError: a rank samples fewer sequences per step than ``algorithm.ppo_mini_batches``.
    """
    dp_size = config.engine.data_parallel_size(world_size)
    prompts, n, count = config.trainer.prompts_per_step, config.rollout.n, config.algorithm.ppo_mini_batches
    local = prompts // dp_size * n
    if local < count:
        raise ConfigError(
            f"each of the {dp_size} data-parallel ranks samples {local} sequences per step (trainer.prompts_per_step"
            f"={prompts} / {dp_size} x rollout.n={n}), fewer than algorithm.ppo_mini_batches={count} optimizer "
            f"steps; raise trainer.prompts_per_step or rollout.n, or set algorithm.ppo_mini_batches <= {local}."
        )
