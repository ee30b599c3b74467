"""Typed configuration of ``drivetrain grpo``: its sections, their defaults (the embedded job) and derived values.

Loading is the job runtime's command config layer (:mod:`drivetrain_roles.runtime.command_config`). The defaults are the
embedded job: the arithmetic model of ``drivetrain sft``, warmed up by a short SFT run to a policy that is sometimes
right (10-23% held-out accuracy), then trained by GRPO with an exact-answer reward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from drivetrain_engine_core.config import (
    CheckpointConfig,
    ConfigError,
    EngineConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
)
from drivetrain_engine_core.rollout import SamplingConfig

from ..advantage_estimators import OUTCOME_ESTIMATORS, AdvantageConfig
from ..algorithm_section import AlgorithmSection
from ..command_sections import (
    USER_MODEL_MAX_NEW_TOKENS,
    DataConfig,
    LoopConfig,
    builtin_model,
    for_a_user_model,
    merged_sections,
)
from ..jobs.default_assets import BUILTIN_MODEL
from ..losses.names import choose
from ..losses.policy import PolicyLossConfig
from .router_replay import RouterReplayOption

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass(kw_only=True, frozen=True)
class RolloutConfig(RouterReplayOption):
    """How responses are sampled (and whether routed experts are recorded: :class:`RouterReplayOption`).

    Attributes:
        name: the registered rollout backend (``hf``: Hugging Face ``generate``; see ``drivetrain plugins``).
        n: responses per prompt (the group whose rewards are normalised together).
        temperature: sampling temperature (> 0); the actor's and reference's log-probs use the same one.
        top_k: sample among the ``top_k`` likeliest tokens only (verl's and vLLM's ``top_k``; 0: all, verl's -1).
        top_p: sample among the likeliest tokens whose probabilities sum to ``top_p`` (1: all).
        min_p: drop tokens less likely than ``min_p`` times the likeliest one (0: none).
        max_new_tokens: most tokens of one response.
        bucket_mb: the weight hand-off's bucket size in MiB.

    With ``top_k``/``top_p``/``min_p`` the rollout samples from the truncated, renormalised distribution and
    reports its log-probs, while the actor's are of the full one at the temperature (as in verl and TRL): the
    policy ratio and ``rollout/log_prob_diff_max`` then include the truncation.
    """

    name: str = "hf"
    n: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 6
    bucket_mb: float = 64.0

    least_n: ClassVar[tuple[int, str]] = (2, "GRPO compares responses to one prompt")
    """The fewest responses per prompt the command can learn from, and why."""

    def __post_init__(self) -> None:
        least, why = self.least_n
        if self.n < least:
            raise ConfigError(f"rollout.n must be >= {least} ({why}), got {self.n}.")
        if not self.temperature > 0:
            raise ConfigError(f"rollout.temperature must be > 0 (GRPO samples), got {self.temperature}.")
        if self.max_new_tokens < 1 or not self.bucket_mb > 0:
            raise ConfigError("rollout.max_new_tokens must be >= 1 and rollout.bucket_mb > 0.")
        try:
            self.sampling(seed=0)
        except ConfigError as e:
            raise ConfigError(f"rollout.top_k/top_p/min_p: {e} Set them in those ranges.") from e

    def sampling(self, *, seed: int) -> SamplingConfig:
        """One step's sampling: ``n`` responses per prompt at the temperature, truncated as set."""
        return SamplingConfig(
            n=self.n,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            max_new_tokens=self.max_new_tokens,
            seed=seed,
        )


@dataclass(kw_only=True, frozen=True)
class AlgorithmConfig(AlgorithmSection):
    """The objective: advantage estimator, policy loss, aggregation, KL and reward shaping, by verl's names (the
    roles README maps them to TRL's and writes out each formula).

    Attributes:
        adv_estimator: ``grpo``, ``dr_grpo`` (grpo without the division by the deviation), ``rloo``,
            ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline`` (verl's ``algorithm.adv_estimator``;
            ``gae`` needs a critic, which this command does not train).
        gamma: discount per response token of ``reinforce_plus_plus`` (no other estimator reads it).
        epsilon: added to the group's reward standard deviation before dividing (``grpo``).
        scale_by_std: ``grpo`` only: divide each group's centred rewards by their standard deviation (unset: yes;
            ``false`` is Dr. GRPO's advantage; verl's ``norm_adv_by_std_in_grpo``, TRL's ``scale_rewards``).
        loss_mode: the policy loss (verl's ``actor.policy_loss.loss_mode``): ``vanilla`` (PPO-clip, with dual-clip),
            ``gspo`` (one clipped ratio per sequence; takes ``loss_agg_mode=seq-mean-token-mean``) or ``cispo``
            (the clipped ratio as a constant weight of ``-A log pi``).
        clip_ratio: PPO clip range (ratio clipped to ``[1 - clip_ratio, 1 + clip_ratio]``).
        clip_ratio_low: the lower clip range, ``1 - clip_ratio_low`` (unset: ``clip_ratio``); ``cispo`` takes
            ``>= 1`` for no lower bound (verl's CISPO example: 10).
        clip_ratio_high: the upper clip range, ``1 + clip_ratio_high`` (unset: ``clip_ratio``); DAPO's clip-higher
            sets it above ``clip_ratio_low`` (0.28 against 0.2).
        clip_ratio_c: the dual-clip constant of ``vanilla`` (> 1): a negative advantage's loss is at most
            ``clip_ratio_c x |A|``; ``null`` disables dual-clip.
        kl_loss_coef: weight of the KL penalty to the reference policy (0 disables it and the reference).
        kl_estimator: ``k1``, ``k2``, ``k3`` (``low_var_kl``) or ``abs`` (verl's ``kl_loss_type``; also
            ``kl``, ``mse``).
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
            ``seq-mean-token-sum-norm`` (Dr. GRPO's constant length: token sums / ``loss_scale_factor``, averaged
            over sequences) or ``token-sum``.
        loss_scale_factor: the constant length of ``seq-mean-token-sum-norm`` (unset: ``rollout.max_new_tokens``,
            TRL's ``max_completion_length``).
        filter_groups: DAPO's dynamic sampling filter: groups whose rewards are all equal leave the loss (their
            loss mask is emptied: no gradient, no tokens counted); no prompts are sampled to replace them.
        overlong_buffer_len: DAPO's soft overlong punishment: a response longer than ``rollout.max_new_tokens -
            overlong_buffer_len`` tokens loses up to ``overlong_penalty_factor`` reward, linearly; 0 disables it.
        overlong_penalty_factor: the penalty of a response of ``rollout.max_new_tokens`` tokens.
        ppo_mini_batches: optimizer steps per epoch over one rollout (its sequences split evenly; whole
            groups are not kept together, each sequence carries its own advantage). 1 is on-policy GRPO: the
            ratio is 1 and nothing is clipped; more reuse each sample, and the clip bounds the later steps.
        ppo_epochs: passes over one rollout (the sequences reshuffled each pass).
        reward_function: the reward of each response: ``exact_match`` (1 when the response, stripped, is the
            data's answer, ``data.response_key``), or the user's function as ``package.module:function`` or
            ``path/to/file.py:function`` (verl's custom reward function), called as ``function(prompts=...,
            completions=..., references=...)`` with lists of texts (a TRL reward function reads
            ``completions`` the same way) and returning one number per completion.
        rollout_is_cap: the truncated importance-sampling correction: each token's policy loss is weighted by
            ``min(pi_old / pi_rollout, rollout_is_cap)``, the actor's probability of the token before the update
            over the rollout's when it sampled it (no gradient through the weight). Corrects samples of older
            weight versions (``trainer.mode``) and a rollout engine whose numbers differ from the trainer's.
            Unset: 2.0 with ``trainer.mode=one_step_off`` or ``async``, off with ``sync``; ``null`` turns it off.
    """

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    epsilon: float = 1e-6
    scale_by_std: bool | None = None
    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    kl_loss_coef: float = 0.001
    kl_estimator: str = "k3"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    filter_groups: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    ppo_mini_batches: int = 4
    ppo_epochs: int = 1
    reward_function: str = "exact_match"
    rollout_is_cap: float | None = None

    def __post_init__(self) -> None:
        self._check_shared_fields()
        if not self.epsilon > 0:
            # NOTE: a group whose rewards are all equal (common with exact-match rewards) has std 0: 0/0 = NaN.
            raise ConfigError(f"algorithm.epsilon must be > 0 (1e-6 is the default), got {self.epsilon}.")
        try:
            estimator = self.advantage_config()
        except ValueError as e:
            raise ConfigError(f"algorithm.{e}") from e
        if estimator.needs_critic:
            raise ConfigError(
                f"algorithm.adv_estimator={self.adv_estimator!r} needs a critic's values, and drivetrain grpo trains "
                f"no critic; choose one of {', '.join(OUTCOME_ESTIMATORS)} (GAE: a job with a critic, PPO)."
            )

    def advantage_config(self) -> AdvantageConfig:
        """The estimator's settings."""
        return AdvantageConfig(
            adv_estimator=self.adv_estimator,
            epsilon=self.epsilon,
            scale_by_std=self.scale_by_std,
            gamma=self.gamma,
        )

    def policy_loss(self, *, max_new_tokens: int) -> PolicyLossConfig:
        """The shared actor loss, with the truncated importance-sampling cap of the off-policy modes."""
        shared = super().policy_loss(max_new_tokens=max_new_tokens)
        return dataclasses.replace(shared, rollout_is_cap=self.rollout_is_cap)


@dataclass(kw_only=True, frozen=True)
class TrainerConfig(LoopConfig):
    """The GRPO loop; the fields and checks every command shares come from :class:`LoopConfig`.

    Attributes:
        total_steps: policy updates (each: one rollout, one optimizer step, one weight hand-off).
        prompts_per_step: prompts per step over all data-parallel ranks (divisible by their number).
        warm_start_steps: with ``model.path=builtin:arithmetic``, SFT steps run first (in ``<run>/warm_start``)
            to get a policy that is sometimes right; GRPO starts from its ``final_model``. At least 1 with the
            embedded model (it exists only as the warm start's output); not read for any other model.
        warm_start_batch_size: examples per warm-start SFT step.
        seed: seed of the prompt order and of the sampling.
        mode: when responses are generated relative to training (docs/architecture.md §8.2): ``sync`` (generate
            step k's responses with the weights of step k, then train), ``one_step_off`` (step k trains on
            responses the weights of step k - 1 generated while step k - 1 trained: ``async`` with
            ``max_staleness=1``) or ``async`` (a rollout thread generates ahead while the trainer trains, at
            most ``max_staleness`` versions behind).
        max_staleness: ``async`` only: how many weight versions the responses a step trains on may lag the
            policy (0 generates nothing ahead and reproduces ``sync``); a group with a token older than that is
            dropped from the loss and counted (``async/dropped_samples``).
    """

    total_steps: int = 120
    prompts_per_step: int = 32
    warm_start_steps: int = 175
    warm_start_batch_size: int = 64
    eval_every: int = 20
    save_every: int = 50
    mode: str = "sync"
    max_staleness: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        choose_mode(self.mode)
        self._require_at_least(0, "max_staleness")
        self._require_at_least(1, "prompts_per_step")
        self._require_at_least(0, "warm_start_steps")
        self._require_at_least(1, "warm_start_batch_size")


TRAINER_MODES = ("sync", "one_step_off", "async")
"""``trainer.mode``'s values."""

DEFAULT_ROLLOUT_IS_CAP = 2.0
"""``algorithm.rollout_is_cap`` when a mode other than ``sync`` leaves it unset (verl's and the TIS paper's)."""


def choose_mode(mode: str) -> None:
    """Refuse an unknown ``trainer.mode``, naming the known ones and the closest."""
    try:
        choose("mode", mode, TRAINER_MODES)
    except ConfigError as e:
        # NOTE: YAML reads off/on/no/yes as booleans, so trainer.mode=off arrives as 'False'.
        hint = " (YAML read a boolean: off, on, no and yes are booleans)" if mode in ("True", "False") else ""
        raise ConfigError(f"trainer.{e}{hint}") from e


def generation_lag(trainer: TrainerConfig) -> int | None:
    """How many versions ahead the rollout generates: ``None`` in ``sync`` (no rollout thread; generated in
    the step), 1 in ``one_step_off``, ``max_staleness`` in ``async``."""
    return {"sync": None, "one_step_off": 1}.get(trainer.mode, trainer.max_staleness)


# NOTE: ppo shares these defaults; the names stay private, as GRPOConfig's (API-checked) signature shows them.
def _default_engine() -> EngineConfig:
    """The engine section of ``grpo`` and ``ppo``: micro-batches cut by a budget of 4096 tokens."""
    return EngineConfig(micro_batch=MicroBatchConfig(micro_batch_size=None, max_tokens=4096))


USER_MODEL_LR = 1e-6
"""The GRPO learning rate of any model but the embedded one (verl's actor default, TRL's ``GRPOConfig``)."""


def _default_optimizer() -> OptimizerConfig:
    return OptimizerConfig(lr=2e-4, weight_decay=0.0, clip_grad=1.0, lr_schedule="constant", warmup_steps=10)


def _default_checkpoint() -> CheckpointConfig:
    """The checkpoint section of ``grpo`` and ``ppo``: the last two steps kept."""
    return CheckpointConfig(max_ckpt_to_keep=2)


@dataclass(kw_only=True, frozen=True)
class GRPOConfig:
    """Everything one GRPO run needs; the defaults are the embedded arithmetic job.

    Attributes:
        model: the policy to train: ``builtin:arithmetic`` (warm-started by SFT), or a model directory such as
            the ``final_model`` of a ``drivetrain sft`` run.
        engine: the actor's (and reference's) engine config.
        optimizer: the actor's AdamW and LR schedule.
        checkpoint: checkpoint contents and retention.
        data: prompts (``data.prompt_key``) and their reference answers (``data.response_key``), which the
            reward function reads (``algorithm.reward_function``).
        rollout: sampling and the weight hand-off.
        algorithm: the GRPO objective.
        trainer: the loop.
    """

    model: ModelConfig = field(default_factory=builtin_model)
    engine: EngineConfig = field(default_factory=_default_engine)
    optimizer: OptimizerConfig = field(default_factory=_default_optimizer)
    checkpoint: CheckpointConfig = field(default_factory=_default_checkpoint)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @staticmethod
    def derived_values(config: DictConfig) -> dict[str, Any]:
        """Unless set: another model than the embedded one trains at lr 1e-6 (verl's actor, TRL's GRPO), on
        examples of up to 1024 tokens, with responses of up to 256 (TRL's ``max_completion_length``); a mode
        other than ``sync`` corrects its older samples with ``algorithm.rollout_is_cap=2.0``."""
        off_policy = (
            {} if config.trainer.mode == "sync" else {"algorithm": {"rollout_is_cap": DEFAULT_ROLLOUT_IS_CAP}}
        )
        return merged_sections(
            off_policy,
            for_a_user_model(
                config,
                {
                    "optimizer": {"lr": USER_MODEL_LR},
                    "rollout": {"max_new_tokens": USER_MODEL_MAX_NEW_TOKENS},
                },
            ),
        )

    def __post_init__(self) -> None:
        check_sections(self, self.algorithm.overlong_buffer_len, self.algorithm.ppo_mini_batches)


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


class PolicyJobConfig(RolloutJobConfig, Protocol):
    """A :class:`RolloutJobConfig` with the sections that train the policy: optimizer, checkpoint, algorithm."""

    @property
    def optimizer(self) -> OptimizerConfig: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...
    @property
    def algorithm(self) -> AlgorithmSection: ...


def check_sections(config: RolloutJobConfig, overlong_buffer_len: int, ppo_mini_batches: int) -> None:
    """The checks across the sections of a command that samples from its policy (``grpo``, ``ppo``): the embedded
    model's warm start, the overlong buffer within a response, mini-batches that divide a step's sequences.

    Raises:
        ConfigError: naming the settings and the fix.
    """
    if config.model.path == BUILTIN_MODEL and config.trainer.warm_start_steps < 1:
        # NOTE: 0 ran one step anyway (the embedded model is made by its warm start).
        raise ConfigError(
            "trainer.warm_start_steps=0 with model.path=builtin:arithmetic: the embedded model is the output of its "
            f"SFT warm start, so it needs at least 1 step ({type(config.trainer)().warm_start_steps} by default). Set "
            "trainer.warm_start_steps >= 1, or give model.path (a drivetrain sft run's final_model), which starts as is."
        )
    buffer, longest = overlong_buffer_len, config.rollout.max_new_tokens
    if buffer >= longest:
        raise ConfigError(
            f"algorithm.overlong_buffer_len={buffer} must be below rollout.max_new_tokens={longest} (the penalty "
            f"starts {buffer} tokens before the longest response); lower it, or raise rollout.max_new_tokens."
        )
    sequences = config.trainer.prompts_per_step * config.rollout.n
    if sequences % ppo_mini_batches:
        # NOTE: mini-batches of ceil(sequences / k) made fewer than k optimizer steps (9 sequences, k=4: 3).
        raise ConfigError(
            f"algorithm.ppo_mini_batches={ppo_mini_batches} must divide the sequences of a "
            f"step, trainer.prompts_per_step x rollout.n = {config.trainer.prompts_per_step} x {config.rollout.n} "
            f"= {sequences}, so that each of its optimizer steps takes as many; choose a divisor of {sequences}."
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


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> GRPOConfig:
    """Defaults, then ``config_file`` (YAML), then ``overrides`` (``a.b.c=value``), as a checked config.

    Raises:
        ConfigError: unreadable YAML, a malformed override, an unknown key or an invalid value.
        PluginError: ``engine.backend`` names a backend that is not installed.
    """
    from ..runtime.command_config import load_config as load_command_config

    return load_command_config(GRPOConfig, config_file, overrides)
