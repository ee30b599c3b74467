"""The option names TRL and verl users type, mapped to the command's own field for the "did you mean" message.

``learning_rate=1e-5`` (TRL's name) was refused as an unknown option with a list of sections and no pointer to
``optimizer.lr``. Foreign names are never accepted in place of the field (a config means one thing, written one
way): the message says what to write instead. Each entry lists the fields it may mean, first match wins, so one
name serves every command (TRL's ``beta`` is ``dpo.beta`` in DPO and ``algorithm.kl_loss_coef`` in GRPO).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from drivetrain_engine_core.backend import ConfigError
from drivetrain_engine_core.job import field_types, nested_dataclass


class Foreign(NamedTuple):
    """Where a foreign name comes from and what it may mean here (fields: first match wins; ``--x``: a command
    line option). A ``note`` says how the meaning differs, and then the value given is not offered as is."""

    origin: str
    fields: tuple[str, ...]
    note: str = ""


_STEPS = "drivetrain counts optimizer steps, not epochs"
_GLOBAL = "sequences per optimizer step over all ranks, not per device"
_REWARD_MODEL = "a reward model is its folder listed there, beside any functions, e.g. [exact_match,<folder>]"

FOREIGN_NAMES: dict[str, Foreign] = {
    # TRL / the Hugging Face Trainer (TrainingArguments, SFTConfig, DPOConfig, GRPOConfig, ScriptArguments)
    "learning_rate": Foreign("TRL", ("optimizer.lr",)),
    "num_train_epochs": Foreign("TRL", ("trainer.total_steps",), _STEPS),
    "max_steps": Foreign("TRL", ("trainer.total_steps",)),
    "per_device_train_batch_size": Foreign(
        "TRL", ("trainer.batch_size", "trainer.prompts_per_step"), _GLOBAL
    ),
    "gradient_accumulation_steps": Foreign(
        "TRL", ("trainer.batch_size", "trainer.prompts_per_step"), f"{_GLOBAL}; micro-batches follow it"
    ),
    "max_seq_length": Foreign("TRL", ("data.max_length",)),
    "max_length": Foreign("TRL", ("data.max_length",)),
    "num_generations": Foreign("TRL", ("rollout.n",)),
    "max_completion_length": Foreign("TRL", ("rollout.max_new_tokens", "trainer.max_new_tokens")),
    "beta": Foreign("TRL", ("dpo.beta", "algorithm.kl_loss_coef")),
    "kl_coef": Foreign("TRL", ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_loss_coef")),
    "loss_type": Foreign("TRL", ("dpo.loss_type", "algorithm.loss_agg_mode")),
    "temperature": Foreign("TRL", ("rollout.temperature",)),
    "warmup_steps": Foreign("TRL", ("optimizer.warmup_steps",)),
    "weight_decay": Foreign("TRL", ("optimizer.weight_decay",)),
    "max_grad_norm": Foreign("TRL", ("optimizer.clip_grad",)),
    "lr_scheduler_type": Foreign("TRL", ("optimizer.lr_schedule",)),
    "save_steps": Foreign("TRL", ("trainer.save_every",)),
    "eval_steps": Foreign("TRL", ("trainer.eval_every",)),
    "seed": Foreign("TRL", ("trainer.seed",)),
    "report_to": Foreign("TRL", ("trainer.report_to",)),
    "output_dir": Foreign("TRL", ("--output-dir",)),
    "model_name_or_path": Foreign("TRL", ("model.path",)),
    "gradient_checkpointing": Foreign("TRL", ("model.gradient_checkpointing",)),
    "dataset_name": Foreign("TRL", ("data.train_files",)),
    "dataset_config": Foreign("TRL", ("data.dataset_config",)),
    "dataset_train_split": Foreign("TRL", ("data.train_split",)),
    "dataset_test_split": Foreign("TRL", ("data.val_split",)),
    "reward_funcs": Foreign("TRL", ("algorithm.reward_functions",)),
    # verl (ppo_trainer.yaml, sft_trainer.yaml)
    "actor_rollout_ref.actor.optim.lr": Foreign("verl", ("optimizer.lr",)),
    "actor_rollout_ref.model.path": Foreign("verl", ("model.path",)),
    "actor_rollout_ref.rollout.n": Foreign("verl", ("rollout.n",)),
    "actor_rollout_ref.rollout.temperature": Foreign("verl", ("rollout.temperature",)),
    "actor_rollout_ref.actor.kl_loss_coef": Foreign("verl", ("algorithm.kl_loss_coef",)),
    "actor_rollout_ref.actor.clip_ratio": Foreign("verl", ("algorithm.clip_ratio",)),
    "actor_rollout_ref.actor.loss_agg_mode": Foreign("verl", ("algorithm.loss_agg_mode",)),
    "critic.optim.lr": Foreign("verl", ("critic.optimizer.lr",)),
    "optim.lr": Foreign("verl", ("optimizer.lr",)),
    "model.partial_pretrain": Foreign("verl", ("model.path",)),
    "data.train_batch_size": Foreign("verl", ("trainer.prompts_per_step", "trainer.batch_size")),
    "data.max_prompt_length": Foreign(
        "verl", ("data.max_length",), "the budget of prompt and response together"
    ),
    "data.max_response_length": Foreign("verl", ("rollout.max_new_tokens",)),
    "trainer.total_epochs": Foreign("verl", ("trainer.total_steps",), _STEPS),
    "trainer.total_training_steps": Foreign("verl", ("trainer.total_steps",)),
    "trainer.save_freq": Foreign("verl", ("trainer.save_every",)),
    "trainer.test_freq": Foreign("verl", ("trainer.eval_every",)),
    "trainer.logger": Foreign("verl", ("trainer.report_to",)),
    "trainer.default_local_dir": Foreign("verl", ("--output-dir",)),
    "reward_model.enable": Foreign("verl", ("algorithm.reward_functions",), _REWARD_MODEL),
    "reward_model.model.path": Foreign("verl", ("algorithm.reward_functions",), _REWARD_MODEL),
    "reward_model.micro_batch_size_per_gpu": Foreign("verl", ("reward_model.micro_batch_size",)),
}
"""Foreign option name (dotted as typed) -> where it comes from and the fields it may mean here."""


def check_foreign_names(layer: Mapping[str, Any], cls: type) -> None:
    """Refuse the first option of ``layer`` that ``cls`` does not have and that is another trainer's name for one
    of its fields, naming the field to write; other unknown options are left to ``check_keys``.

    Raises:
        ConfigError: ``unknown option learning_rate (TRL's name); did you mean optimizer.lr? ...``.
    """
    for path, value in _paths(layer):
        foreign = FOREIGN_NAMES.get(path)
        if foreign is None or has_field(cls, path):
            continue
        target = next((f for f in foreign.fields if f.startswith("--") or has_field(cls, f)), None)
        if target is None:
            continue
        raise ConfigError(
            f"unknown option {path} ({foreign.origin}'s name); did you mean {target}? {_fix(target, value, foreign)}"
        )


def _fix(target: str, value: Any, foreign: Foreign) -> str:
    """What to write instead: the field with the value given, or the field and how its meaning differs."""
    if foreign.note:
        return f"Set {target} instead ({foreign.note})."
    if target.startswith("--"):
        return f"Pass {target} {value} instead."
    return f"Write {target}={value!r} instead."


def has_field(cls: type, path: str) -> bool:
    """Whether the dotted ``path`` names a field of the config dataclass ``cls`` (or one of its sections)."""
    owner: type | None = cls
    for part in path.split("."):
        annotation = field_types(owner).get(part) if owner is not None else None
        if annotation is None:
            return False
        owner = nested_dataclass(annotation)
    return True


def _paths(layer: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Every dotted key of ``layer`` with its value: sections and their leaves (a foreign section such as
    ``actor_rollout_ref`` is matched by its leaves)."""
    paths: list[tuple[str, Any]] = []
    for key, value in layer.items():
        path = f"{prefix}{key}"
        paths.append((path, value))
        if isinstance(value, Mapping):
            paths += _paths(value, f"{path}.")
    return paths


__all__ = ["FOREIGN_NAMES", "Foreign", "check_foreign_names", "has_field"]
