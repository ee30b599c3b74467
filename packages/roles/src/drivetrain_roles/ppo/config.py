"""Typed configuration of ``drivetrain ppo``: its sections, their defaults (the embedded job) and presets.

PPO shares ``drivetrain grpo``'s sections where they mean the same (model, engine, optimizer, checkpoint, data,
the rollout, the loop) and adds its own: the ``critic`` (a value model on its own engine) and an ``algorithm``
section with GAE, value clipping and KL control, by verl's names. The defaults are the embedded job: the
arithmetic model of ``drivetrain sft``, warmed up by a short SFT run, then trained by PPO with an exact-answer
reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from drivetrain_engine_core.backend import ConfigError, EngineConfig, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import CheckpointConfig

from ..command_sections import (
    USER_MODEL_MAX_NEW_TOKENS,
    DataConfig,
    RunOptimizerConfig,
    builtin_model,
    model_presets,
)
from ..losses.config import ValueLossConfig
from ..losses.names import canonical_estimator, choose
from ..reward_model.config import RewardModelConfig
from ..rl.advantage_config import ADV_ESTIMATORS, CRITIC_ESTIMATORS
from ..rl.algorithm_section import AlgorithmSection
from ..rl.environment_config import EnvironmentConfig
from ..rl.job_config import (
    POLICY_WARMUP_STEPS,
    USER_MODEL_LR,
    check_reward_source,
    check_sections,
)

# NOTE: the shared defaults keep their private names here, as PPOConfig's signature shows them.
from ..rl.job_config import default_checkpoint as _default_checkpoint
from ..rl.job_config import default_engine as _default_engine
from ..rl.rollout_config import RolloutConfig as SharedRolloutConfig
from ..rl.trainer_config import TrainerConfig as SharedTrainerConfig
from ..runtime.command_config.presets import PresetChoice

if TYPE_CHECKING:
    from ..advantages import AdaptiveKLController, FixedKLController

KL_CONTROLLERS: tuple[str, ...] = ("fixed", "adaptive")
USER_MODEL_CRITIC_LR = 1e-5
"""The critic's learning rate for any model but the embedded one (verl's ``critic.optim.lr``)."""


@dataclass(kw_only=True, frozen=True)
class RolloutConfig(SharedRolloutConfig):
    """How responses are sampled (the shared section of :mod:`drivetrain_roles.rl.rollout_config`: PPO's critic
    gives each response its own baseline, so one response per prompt is enough).

    Attributes:
        n: responses per prompt (each is scored against the critic's values, not against its group).
    """

    least_n: ClassVar[tuple[int, str]] = (1, "every prompt needs a response")
    n: int = 8


@dataclass(kw_only=True, frozen=True)
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (verl's ``algorithm.kl_ctrl``).

    Attributes:
        type: ``fixed`` (the coefficient stays ``kl_coef``) or ``adaptive`` (Ziegler et al. 2019: raised when
            the measured KL is above ``target_kl``, lowered when below, by at most 20% per ``horizon`` samples).
        kl_coef: the (starting) coefficient.
        target_kl: the KL per token the adaptive controller steers towards.
        horizon: samples over which the adaptive controller corrects a 20% error.
    """

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        choose("algorithm.kl_ctrl.type", self.type, KL_CONTROLLERS)
        if self.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {self.kl_coef}.")
        if not (self.target_kl > 0 and self.horizon > 0):
            raise ConfigError("algorithm.kl_ctrl.target_kl and algorithm.kl_ctrl.horizon must be > 0.")

    def controller(self) -> FixedKLController | AdaptiveKLController:
        """A new controller at ``kl_coef``."""
        # torch: not needed to build the config
        from ..advantages import AdaptiveKLController, FixedKLController

        if self.type == "fixed":
            return FixedKLController(self.kl_coef)
        return AdaptiveKLController(init_kl_coef=self.kl_coef, target=self.target_kl, horizon=self.horizon)


@dataclass(kw_only=True, frozen=True)
class AlgorithmConfig(AlgorithmSection):
    """The objective: GAE over the critic's values, the policy loss, value clipping and the KL penalty, by verl's
    names (the roles README maps them to TRL's).

    Attributes:
        adv_estimator: ``gae`` (generalised advantage estimation over the critic's values; the only estimator
            that reads them: the critic-free ones are ``drivetrain grpo``'s).
        gamma: discount per response token.
        lam: GAE's lambda (1: the Monte-Carlo return minus the value; 0: one-step TD).
        loss_mode: the policy loss: ``vanilla`` (PPO-clip, with dual-clip), ``gspo`` (one clipped ratio per
            sequence; takes ``loss_agg_mode=seq-mean-token-mean``) or ``cispo``.
        clip_ratio: PPO clip range (ratio clipped to ``[1 - clip_ratio, 1 + clip_ratio]``).
        clip_ratio_low: the lower clip range (unset: ``clip_ratio``).
        clip_ratio_high: the upper clip range (unset: ``clip_ratio``; DAPO's clip-higher sets it above).
        clip_ratio_c: the dual-clip constant of ``vanilla`` (> 1); ``null`` disables dual-clip.
        cliprange_value: the critic's value clipping: a new value may move at most this far from the rollout's
            before the clipped term takes over (verl's ``critic.cliprange_value``).
        use_kl_in_reward: subtract ``kl_ctrl``'s coefficient x the KL to the reference (``kl_penalty``'s
            estimator) from every response token's reward, as Ziegler et al. and verl's PPO do.
        kl_penalty: the per-token KL estimator in the reward: ``k1`` (verl's ``kl``), ``k2``, ``k3``, ``abs``.
        kl_ctrl: the coefficient of the KL in the reward, fixed or adaptive.
        kl_loss_coef: weight of a KL penalty in the actor's loss instead (or as well); 0 disables it.
        kl_estimator: the estimator of the KL loss: ``k1``, ``k2``, ``k3`` (``low_var_kl``) or ``abs``.
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
            ``seq-mean-token-sum-norm`` or ``token-sum`` (the actor's loss; the critic's is a token mean).
        loss_scale_factor: the constant length of ``seq-mean-token-sum-norm`` (unset: ``rollout.max_new_tokens``).
        overlong_buffer_len: DAPO's soft overlong punishment over the last N tokens of
            ``rollout.max_new_tokens``; 0 disables it.
        overlong_penalty_factor: the penalty of a response of ``rollout.max_new_tokens`` tokens.
        ppo_mini_batches: optimizer steps of the actor and of the critic per epoch over one rollout.
        ppo_epochs: passes over one rollout (the sequences reshuffled each pass).
        reward_function: ``exact_match``, ``math_verify``, ``step_credit``, or the user's function as
            ``package.module:function`` or ``path/to/file.py:function``, or a reward model's folder (as in
            ``drivetrain grpo``): the score of
            each response, placed on its last token. The same as ``reward_functions=[it]``; setting one clears
            the other.
        reward_functions: several reward functions; the score is their weighted sum (as in ``drivetrain grpo``);
            ``[]`` with ``environment.name``: none, the environment's reward alone.
        reward_weights: one weight per function of ``reward_functions``; unset: 1 each.
        reward_timeout_s: seconds the reward functions may take over one step's responses (``null``: no limit).
        reward_failure_value: the score of a response whose function raised or ran out of time, counted in
            ``reward/<name>/failed``; ``null``: such a function stops the run.
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    cliprange_value: float = 0.5
    use_kl_in_reward: bool = True
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    ppo_mini_batches: int = 2
    ppo_epochs: int = 1
    reward_function: str | None = "exact_match"
    reward_functions: tuple[str, ...] | None = None
    reward_weights: tuple[float, ...] | None = None
    reward_timeout_s: float | None = 300.0
    reward_failure_value: float | None = None

    def __post_init__(self) -> None:
        name = choose("algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        if name not in CRITIC_ESTIMATORS:
            raise ConfigError(
                f"algorithm.adv_estimator={name!r} needs no critic: drivetrain ppo would train a critic whose values "
                f"nothing reads. Set algorithm.adv_estimator=gae (GAE over the critic's values), or run "
                f"drivetrain grpo algorithm.adv_estimator={name} (no critic)."
            )
        self._check_shared_fields()
        if not (0 < self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(
                f"algorithm.gamma must be in (0, 1] and algorithm.lam in [0, 1], got {self.gamma}, {self.lam}."
            )
        try:
            canonical_estimator(self.kl_penalty)
            self.value_loss()
        except ValueError as e:
            raise ConfigError(f"algorithm.{str(e).replace('kl_estimator=', 'kl_penalty=', 1)}") from e
        if self.kl_ctrl.type == "adaptive" and not self.use_kl_in_reward:
            raise ConfigError(
                "algorithm.kl_ctrl.type=adaptive steers the KL coefficient of the reward, but "
                "algorithm.use_kl_in_reward=false; set use_kl_in_reward=true, or kl_ctrl.type=fixed."
            )

    @property
    def needs_reference(self) -> bool:
        """Whether a KL term (in the reward or in the loss) reads the reference's log-probs."""
        return self.use_kl_in_reward or self.kl_loss_coef > 0

    def value_loss(self) -> ValueLossConfig:
        """The critic's clipped value loss, a token mean (verl's ``critic.loss_agg_mode`` default)."""
        return ValueLossConfig(cliprange_value=self.cliprange_value)


@dataclass(kw_only=True, frozen=True)
class CriticConfig:
    """The critic: a value model on its own engine (``engine``'s backend and layout), started from the policy
    PPO starts from with a fresh value head.

    Attributes:
        optimizer: the critic's AdamW and LR schedule; ``total_steps`` follows ``trainer.total_steps`` (the critic
            updates at every step) unless set.
    """

    optimizer: RunOptimizerConfig = field(
        default_factory=lambda: RunOptimizerConfig(
            lr=1e-3, weight_decay=0.0, clip_grad=1.0, lr_schedule="constant", warmup_steps=0
        )
    )


@dataclass(kw_only=True, frozen=True)
class TrainerConfig(SharedTrainerConfig):
    """The PPO loop: the shared fields (:mod:`drivetrain_roles.rl.trainer_config`), plus the critic's warm-up.

    Attributes:
        total_steps: PPO steps (each: one rollout, the critic's update, the actor's update, one weight hand-off).
        warm_start_steps: with an embedded ``model.path`` (``builtin:<task>``), SFT steps run first (in ``<run>/warm_start``);
            the actor and the critic's trunk start from its ``final_model``. At least 1 with the embedded
            model; not read for any other model.
        critic_warmup: the first steps train the critic alone, the actor frozen (verl's ``trainer.critic_warmup``):
            the fresh value head's first values are noise, and so would be the advantages.
        mode: ``sync`` only: a PPO step trains its actor and critic on the samples of its own weights (the
            asynchronous modes are ``drivetrain grpo``'s; the critic's values of stale samples are not corrected).
    """

    # NOTE: PPO's defaults (actor lr, n, critic warm-up) were tuned on a 200-step warm start; GRPO's shorter one
    # has not been measured with PPO's critic.
    warm_start_steps: int = 200
    critic_warmup: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_at_least(0, "critic_warmup")
        if self.mode != "sync":
            raise ConfigError(
                f"trainer.mode={self.mode!r}: drivetrain ppo trains on the samples of the step's own weights only; "
                "set trainer.mode=sync, or use drivetrain grpo for one_step_off/async (docs/architecture.md §8.2)."
            )


def _default_optimizer() -> RunOptimizerConfig:
    return RunOptimizerConfig(lr=1e-4, weight_decay=0.0, clip_grad=1.0, lr_schedule="constant")


@dataclass(kw_only=True, frozen=True)
class PPOConfig:
    """Everything one PPO run needs; the defaults are the embedded arithmetic job.

    Attributes:
        model: the policy to train: an embedded model (``builtin:arithmetic``, ``builtin:multistep``: warm-started by
            SFT), or a model directory.
        engine: the engine config of the actor, the critic and the reference (each its own engine).
        optimizer: the actor's AdamW and LR schedule; ``total_steps`` follows the steps the actor trains
            (``trainer.total_steps - trainer.critic_warmup``: its schedule does not move while it is frozen) and
            ``warmup_steps`` is 10, unless set.
        checkpoint: checkpoint contents and retention (the actor's and the critic's).
        data: prompts (``data.prompt_key``) and their reference answers (``data.response_key``).
        rollout: sampling and the weight hand-off.
        critic: the value model.
        algorithm: the PPO objective.
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
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)

    presets: ClassVar[tuple[PresetChoice, ...]] = (
        # Another model than the embedded one trains its actor at lr 1e-6 and its critic at 1e-5 (verl's
        # defaults), with responses of up to 256 tokens.
        model_presets(
            "ppo",
            {
                "optimizer": {"lr": USER_MODEL_LR},
                "critic": {"optimizer": {"lr": USER_MODEL_CRITIC_LR}},
                "rollout": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS},
            },
        ),
    )

    def __post_init__(self) -> None:
        check_sections(self, self.algorithm.overlong_buffer_len, self.algorithm.ppo_mini_batches)
        check_reward_source(self)
        if self.trainer.critic_warmup >= self.trainer.total_steps:
            raise ConfigError(
                f"trainer.critic_warmup={self.trainer.critic_warmup} leaves no step of trainer.total_steps="
                f"{self.trainer.total_steps} to the actor; lower critic_warmup or raise total_steps."
            )
        self.run_optimizer()  # core's optimizer checks, with the run's length
        self.run_critic_optimizer()

    def run_optimizer(self) -> OptimizerConfig:
        """The actor's optimizer as its engine gets it: the schedule spans the steps the actor trains unless set."""
        actor_steps = self.trainer.total_steps - self.trainer.critic_warmup
        return self.optimizer.for_run(actor_steps, POLICY_WARMUP_STEPS)

    def run_critic_optimizer(self) -> OptimizerConfig:
        """The critic's optimizer as its engine gets it: the schedule spans ``trainer.total_steps`` unless set."""
        return self.critic.optimizer.for_run(self.trainer.total_steps, 0)


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> PPOConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown key or an invalid value.
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(PPOConfig, config_file, overrides)
