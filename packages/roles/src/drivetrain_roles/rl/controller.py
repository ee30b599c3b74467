"""GRPO through one colocated Ray worker group: a single controller drives actor, reference and rollout.

The driver holds the prompts and the step logic of :mod:`.step`; the workers hold the engines and the
rollouts. One step: every worker's rollout samples its data-parallel slice of the prompts (whole groups per
rank), the driver scores them (:func:`.step.score`), the actor and reference parts recompute log-probs and the
actor updates through the group's dispatch (:func:`.step.update_with`, the function the single-process
trainer calls too), then every worker hands its actor's weights to its own rollout. Only token ids, log-probs
and metrics cross to the driver; weights never do.

Example::

    config = load_config(None, ["model.path=/path/to/sft/final_model"])
    with ColocatedGRPO.start(config, world_size=2, num_cpus_per_worker=0.5) as grpo:
        for step, examples in enumerate(batches):
            metrics = grpo.step(step, examples)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any, Self

from drivetrain_engine_core.config import ConfigError
from drivetrain_engine_core.errors import BatchError
from drivetrain_engine_core.rollout import RolloutOutput

from ..jobs.assets import model_directory
from ..jobs.data import Example
from ..workers import ColocatedSpec, ColocatedWorkerGroup, RolloutSpec, WorkerSpec
from .config import GRPOConfig, PolicyJobConfig, check_mini_batch_share
from .rewards import load_rewards, reward_metrics
from .step import SEED_STRIDE, PolicyCalls, RolloutBatch, sampling_config, score, update_with
from .trainer import actor_config


def colocated_spec(config: PolicyJobConfig) -> ColocatedSpec:
    """The parts every worker builds: ``actor`` (training engine, GRPO loss), ``reference`` (its own
    inference-only engine; none without a KL penalty), and the ``rollout``, all from ``config.model.path`` (a
    Hub repository id is fetched into the Hugging Face cache here, once, and the workers load its snapshot).

    Raises:
        ConfigError: ``model.path`` is the embedded ``builtin:`` model (run its warm start first and pass the
            ``final_model``), or LoRA is on (the colocated reference does not share the actor's engine yet).
    """
    path = config.model.path
    if path.startswith("builtin:"):
        raise ConfigError(
            f"the colocated GRPO controller needs a model directory, got model.path={path!r}; pass e.g. the "
            "final_model of a drivetrain sft run (or of drivetrain grpo's warm_start)."
        )
    if config.model.lora is not None:
        raise ConfigError(
            "the colocated GRPO controller does not support model.lora yet (its reference would be the "
            "actor's LoRA-disabled engine); unset model.lora or use the single-process drivetrain grpo."
        )
    path = model_directory(path, download=True)
    reference = WorkerSpec(
        role="reference",
        model_config=dataclasses.replace(config.model, path=path),
        engine_config=config.engine,
        checkpoint_config=config.checkpoint,
        role_config={"temperature": config.rollout.temperature},
        cpu_threads=config.trainer.cpu_threads,
        timeout_s=config.engine.dist_timeout_s,
    )
    actor = dataclasses.replace(
        reference, role="actor", optimizer_config=config.run_optimizer(), role_config=actor_config(config)
    )
    parts = (
        {"actor": actor} if config.algorithm.kl_loss_coef == 0 else {"actor": actor, "reference": reference}
    )
    rollout = RolloutSpec(
        name=config.rollout.name,
        model_path=path,
        bucket_mb=config.rollout.bucket_mb,
        options=config.rollout.options,
    )
    return ColocatedSpec(parts=parts, rollout=rollout)


class ColocatedController:
    """What the single controllers of ``drivetrain grpo`` and ``ppo`` share: the group they drive, sampling one
    step's prompts on its rollouts, and the group's shutdown (also as a context manager).

    Args:
        group: the colocated group the controller drives.
        config: the run's configuration (its ``trainer`` and ``rollout`` sections are read here).
        tokenizer: decodes responses for the reward.
    """

    command = ""
    """The job's name in messages (``GRPO``, ``PPO``)."""

    def __init__(self, group: ColocatedWorkerGroup, config: Any, tokenizer: Any) -> None:
        self.group = group
        self.config = config
        self.tokenizer = tokenizer

    def generate(self, step: int, examples: Sequence[Example]) -> RolloutOutput:
        """``examples``' responses from the workers' rollouts; seeds follow the trainer's (seed, step, rank).

        Raises:
            BatchError: not ``trainer.prompts_per_step`` examples: the actor's mini-batch size is set for that
                many, so another count would take another number of optimizer steps than
                ``algorithm.ppo_mini_batches``.
        """
        expected = self.config.trainer.prompts_per_step
        if len(examples) != expected:
            raise BatchError(
                f"a {self.command} step got {len(examples)} prompts, but trainer.prompts_per_step={expected} (the "
                f"actor's mini-batches are sized for it); pass {expected} prompts per step or set "
                f"trainer.prompts_per_step={len(examples)}."
            )
        seed = self.config.trainer.seed + SEED_STRIDE * step
        return self.group.generate([e.prompt_ids for e in examples], sampling_config(self.config, seed=seed))

    def shutdown(self) -> None:
        self.group.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ColocatedGRPO(ColocatedController):
    """The GRPO step of :mod:`.step`, driven over a :class:`~..workers.ColocatedWorkerGroup`.

    Args:
        group: a colocated group with parts ``actor`` (and ``reference`` when the KL penalty is on) and a
            rollout fed by the actor, e.g. from :func:`colocated_spec`.
        config: the run's configuration.
        tokenizer: decodes responses for the reward.
    """

    command = "GRPO"
    config: GRPOConfig

    @classmethod
    def start(
        cls, config: GRPOConfig, *, world_size: int, spec: ColocatedSpec | None = None, **group_options: Any
    ) -> Self:
        """Start the group of ``spec`` (default :func:`colocated_spec`; ``group_options`` go to the group) and
        the controller."""
        from ..jobs.assets import load_tokenizer

        check_mini_batch_share(config, world_size)
        load_rewards(config.algorithm.rewards())  # before the workers start
        spec = spec or colocated_spec(config)
        actor = spec.parts["actor"].model_config
        tokenizer = load_tokenizer(actor.path, trust_remote_code=actor.trust_remote_code)
        return cls(ColocatedWorkerGroup(spec, world_size=world_size, **group_options), config, tokenizer)

    def sample(self, step: int, examples: Sequence[Example]) -> RolloutBatch:
        """Sample ``examples`` on the workers' rollouts (:meth:`generate`) and score them on the driver."""
        return score(examples, self.generate(step, examples), self.tokenizer, self.config)

    def update(self, samples: RolloutBatch) -> dict[str, float]:
        """Old and reference log-probs, one PPO-clip update: the actor's metrics, ``entropy`` and
        ``rollout/log_prob_diff_max`` (see :func:`~.step.update`)."""
        group = self.group
        has_reference = "reference" in group.topologies
        calls = PolicyCalls(
            compute_log_prob=partial(group.call, "actor", "compute_log_prob"),
            compute_ref_log_prob=partial(group.call, "reference", "compute_ref_log_prob")
            if has_reference
            else None,
            update_policy=partial(group.call, "actor", "update_policy"),
        )
        metrics, statistics = update_with(calls, samples)
        return {**metrics, **statistics.metrics()}

    def step(self, step: int, examples: Sequence[Example]) -> dict[str, float]:
        """One GRPO step over ``examples``, then the hand-off of version ``step + 1`` inside every worker."""
        samples = self.sample(step, examples)
        metrics = self.update(samples)
        self.group.sync_rollout(step + 1)
        return {**metrics, **reward_metrics(samples.scores), "train/reward": float(samples.rewards.mean())}


__all__ = ["ColocatedController", "ColocatedGRPO", "colocated_spec"]
