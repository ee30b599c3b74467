"""What the single controllers of ``drivetrain grpo`` and ``ppo`` share: the policy's parts of a colocated Ray
worker group, and the controller base that starts the group, samples a step on its rollouts and builds the calls
of the policy's update.

The driver holds the prompts and the step logic; the workers hold the engines and the rollouts. Only token ids,
log-probs and metrics cross to the driver; weights never do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Self

from drivetrain_engine_core.backend import BatchError, ConfigError
from drivetrain_engine_core.rollout import RolloutOutput

from ..jobs.assets import model_directory
from ..jobs.data import Example
from ..workers import ColocatedSpec, ColocatedWorkerGroup, RolloutSpec, WorkerSpec
from .actor_setup import actor_config
from .job_config import PolicyJobConfig, check_mini_batch_share
from .policy_update import PolicyCalls
from .rewards import load_rewards
from .rollout_plugin import job_rollout_options
from .sampling import SEED_STRIDE, sampling_config


def policy_spec(config: PolicyJobConfig, *, reference: bool) -> ColocatedSpec:
    """The parts every worker builds: ``actor`` (training engine, the policy loss), ``reference`` (its own
    inference-only engine; only when ``reference``), and the ``rollout``, all from ``config.model.path`` (a Hub
    repository id is fetched into the Hugging Face cache here, once, and the workers load its snapshot).

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
    reference_spec = WorkerSpec(
        role="reference",
        model_config=dataclasses.replace(config.model, path=path),
        engine_config=config.engine,
        checkpoint_config=config.checkpoint,
        role_config={"temperature": config.rollout.temperature},
        cpu_threads=config.trainer.cpu_threads,
        timeout_s=config.engine.dist_timeout_s,
    )
    actor = dataclasses.replace(
        reference_spec,
        role="actor",
        optimizer_config=config.run_optimizer(),
        role_config=actor_config(config),
    )
    parts = {"actor": actor, "reference": reference_spec} if reference else {"actor": actor}
    rollout = RolloutSpec(
        name=config.rollout.name,
        model_path=path,
        bucket_mb=config.rollout.bucket_mb,
        options=job_rollout_options(config.rollout, config.trainer),
    )
    return ColocatedSpec(parts=parts, rollout=rollout)


class ColocatedController:
    """What the single controllers of ``drivetrain grpo`` and ``ppo`` share: the group they drive, sampling one
    step's prompts on its rollouts, the calls of the policy's update, and the group's shutdown (also as a context
    manager).

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

    @classmethod
    def _launch(
        cls,
        config: PolicyJobConfig,
        spec: Callable[[], ColocatedSpec],
        *,
        world_size: int,
        group_options: dict[str, Any],
    ) -> Self:
        """Check the config, load the rewards (before the workers start), build ``spec()``, start its group
        (``group_options`` go to it) and the controller with the actor's tokenizer."""
        from ..jobs.assets import load_tokenizer

        check_mini_batch_share(config, world_size)
        if config.environment.enabled:
            raise ConfigError(
                f"environment.name={config.environment.name}: a single controller samples one response per prompt; "
                f"train on episodes with the trainer (drivetrain {cls.command} ...), or leave environment.name unset."
            )
        load_rewards(config.algorithm.rewards())
        parts = spec()
        actor = parts.parts["actor"].model_config
        tokenizer = load_tokenizer(actor.path, trust_remote_code=actor.trust_remote_code)
        return cls(ColocatedWorkerGroup(parts, world_size=world_size, **group_options), config, tokenizer)

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

    def policy_calls(self) -> PolicyCalls:
        """The policy's update calls through the group: the actor's parts, the reference's when it has one."""
        call = self.group.call
        return PolicyCalls(
            compute_log_prob=partial(call, "actor", "compute_log_prob"),
            compute_ref_log_prob=partial(call, "reference", "compute_ref_log_prob")
            if "reference" in self.group.topologies
            else None,
            update_policy=partial(call, "actor", "update_policy"),
        )

    def shutdown(self) -> None:
        self.group.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
