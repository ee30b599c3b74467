"""The ``algorithm`` section of ``drivetrain grpo``: the critic-free objective (advantage estimator, policy loss,
KL, reward shaping), by verl's names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError

from ..losses.config import PolicyLossConfig
from ..rl.advantage_config import OUTCOME_ESTIMATORS, AdvantageConfig
from ..rl.algorithm_section import AlgorithmSection

DEFAULT_ROLLOUT_IS_CAP = 2.0
"""``algorithm.rollout_is_cap`` when a mode other than ``sync`` leaves it unset (verl's and the TIS paper's)."""


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
            data's answer, ``data.response_key``), ``math_verify`` (the answer's math equals the reference's,
            with ``drivetrain-roles[math]``), ``step_credit`` (the embedded multi-step task's), or the user's
            function as ``package.module:function`` or ``path/to/file.py:function``, called with the keywords
            it names (``prompts``, ``completions``, ``completion_messages``, ``completion_ids``, ``references``,
            every data set column; TRL's reward functions and verl's ``compute_score`` as they are) and
            returning one number (or ``None``: not applicable) per completion; or a reward model's folder (TRL's
            model id in ``reward_funcs``: a one-label ``*ForSequenceClassification`` model such as ``drivetrain
            rm``'s ``final_model``, scored on its own engine, see the ``reward_model`` section). The same as
            ``reward_functions=[it]``; setting one clears the other.
        reward_functions: several reward functions (TRL's ``reward_funcs``), each as ``reward_function``; a
            response's reward is their weighted sum, a function returning ``None`` for it left out; each is
            logged as ``reward/<name>``. ``[]`` with ``environment.name``: none, the environment's reward alone.
        reward_weights: one weight per function of ``reward_functions`` (TRL's ``reward_weights``); unset: 1 each.
        reward_timeout_s: seconds the reward functions, run concurrently, may take over one step's responses;
            one still running then is an error naming it (or scores ``reward_failure_value``); ``null``: no
            limit, the functions run one after another on the trainer's thread (for functions that need the
            main thread, e.g. ``signal.alarm``).
        reward_failure_value: the reward of a response whose function raised or ran out of time, counted in
            ``reward/<name>/failed``; ``null``: such a function stops the run, naming it and the row.
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
    reward_function: str | None = "exact_match"
    reward_functions: tuple[str, ...] | None = None
    reward_weights: tuple[float, ...] | None = None
    reward_timeout_s: float | None = 300.0
    reward_failure_value: float | None = None
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
