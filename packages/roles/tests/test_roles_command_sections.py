"""The ``trainer`` fields every command shares: one declaration, the same checks and help in every command."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.runtime.command_config import describe_fields

COMMANDS = ["sft", "grpo", "ppo", "dpo", "rm"]


def _load(command: str, *overrides: str):
    return importlib.import_module(f"drivetrain_roles.{command}.config").load_config(None, list(overrides))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("total_steps", 0, "trainer.total_steps must be >= 1, got 0."),
        ("save_every", -1, "trainer.save_every must be >= 0, got -1."),
        ("eval_samples", -2, "trainer.eval_samples must be >= 0, got -2."),
        ("cpu_threads", 0, "trainer.cpu_threads must be >= 1 or null, got 0."),
    ],
)
def test_shared_trainer_fields_are_checked_alike_in_every_command(command, name, value, message) -> None:
    # On the section itself: through the command, optimizer.total_steps (derived from it) is checked first.
    trainer = _load(command).trainer
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(trainer, **{name: value})


@pytest.mark.parametrize(
    ("command", "override", "message"),
    [
        ("sft", "trainer.batch_size=0", "trainer.batch_size must be >= 1, got 0."),
        ("dpo", "trainer.max_new_tokens=0", "trainer.max_new_tokens must be >= 1, got 0."),
        ("sft", "trainer.loss_agg_mode=mean", "trainer.loss_agg_mode='mean' is not supported"),
        ("grpo", "trainer.prompts_per_step=0", "trainer.prompts_per_step must be >= 1, got 0."),
        ("grpo", "trainer.warm_start_steps=-1", "trainer.warm_start_steps must be >= 0, got -1."),
    ],
)
def test_each_commands_own_trainer_fields_keep_their_checks(command, override, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(command, override)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_trainer_field_has_help_and_a_command_can_say_more(command) -> None:
    trainer = {f.name: f.help for f in describe_fields(_load(command)) if f.name.startswith("trainer.")}
    assert all(trainer.values()), [name for name, text in trainer.items() if not text]
    assert trainer["trainer.cpu_threads"].startswith("intra-op threads per rank")
    if command == "grpo":
        assert trainer["trainer.total_steps"].startswith("policy updates")


@pytest.mark.parametrize("command", COMMANDS)
def test_held_out_files_without_training_files_are_refused(command) -> None:
    """With no ``data.train_files`` every command trains and evaluates on its generated data, and
    ``data.val_files`` (even a file that does not exist) was never opened while the run exited 0."""
    with pytest.raises(
        ConfigError, match=r"data.val_files=\['held_out.jsonl'\] is set without data.train_files"
    ):
        _load(command, "data.val_files=[held_out.jsonl]")
    assert _load(command, "data.train_files=[t.jsonl]", "data.val_files=[held_out.jsonl]").data.val_files
