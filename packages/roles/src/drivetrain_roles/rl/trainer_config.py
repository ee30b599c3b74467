"""The ``trainer`` section of ``drivetrain grpo`` (the loop, shared by ``drivetrain ppo``) and its generation
modes: when responses are generated relative to training."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain_engine_core.backend import ConfigError

from ..command_sections import LoopConfig
from ..losses.names import choose


@dataclass(kw_only=True, frozen=True)
class TrainerConfig(LoopConfig):
    """The GRPO loop; the fields and checks every command shares come from :class:`LoopConfig`.

    Attributes:
        total_steps: policy updates (each: one rollout, one optimizer step, one weight hand-off).
        prompts_per_step: prompts per step over all data-parallel ranks (divisible by their number).
        warm_start_steps: with an embedded ``model.path`` (``builtin:<task>``), SFT steps run first (in ``<run>/warm_start``)
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


def versions_in_flight(trainer: TrainerConfig) -> tuple[int, str]:
    """How many weight versions the rollout may sample from at once (one more than :func:`generation_lag`: the
    requests of older versions finish under theirs), and the setting that says so, for messages."""
    lag = generation_lag(trainer)
    why = f"trainer.mode={trainer.mode}" + (
        f" with trainer.max_staleness={lag}" if trainer.mode == "async" else ""
    )
    return 1 + (lag or 0), why
