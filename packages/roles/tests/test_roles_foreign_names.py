"""TRL's and verl's option names get a pointer to the command's own field, never silent acceptance."""

from __future__ import annotations

from importlib import import_module

import pytest
from drivetrain_engine_core.backend import ConfigError
from drivetrain_roles.runtime.command_config.foreign_names import FOREIGN_NAMES, has_field

COMMANDS = ("sft", "dpo", "rm", "grpo", "ppo")


def load(command: str, *overrides: str, config_file=None):
    return import_module(f"drivetrain_roles.{command}.config").load_config(config_file, list(overrides))


def config_class(command: str) -> type:
    return type(load(command))


@pytest.mark.parametrize(
    ("commands", "override", "message"),
    [
        (COMMANDS, "learning_rate=1e-5", "did you mean optimizer.lr? Write optimizer.lr=1e-05 instead."),
        (
            COMMANDS,
            "num_train_epochs=3",
            "did you mean trainer.total_steps? Set trainer.total_steps instead (drivetrain counts optimizer steps, "
            "not epochs).",
        ),
        (
            COMMANDS,
            "max_steps=100",
            "did you mean trainer.total_steps? Write trainer.total_steps=100 instead.",
        ),
        (("sft", "dpo", "rm"), "per_device_train_batch_size=8", "did you mean trainer.batch_size? Set"),
        (("grpo", "ppo"), "per_device_train_batch_size=8", "did you mean trainer.prompts_per_step? Set"),
        (COMMANDS, "max_seq_length=512", "did you mean data.max_length? Write data.max_length=512 instead."),
        (COMMANDS, "max_length=512", "did you mean data.max_length? Write data.max_length=512 instead."),
        (("grpo", "ppo"), "num_generations=16", "did you mean rollout.n? Write rollout.n=16 instead."),
        (("grpo", "ppo"), "max_completion_length=256", "did you mean rollout.max_new_tokens? Write"),
        (("dpo",), "beta=0.1", "(TRL's name); did you mean dpo.beta? Write dpo.beta=0.1 instead."),
        (
            ("grpo", "ppo"),
            "beta=0.04",
            "did you mean algorithm.kl_loss_coef? Write algorithm.kl_loss_coef=0.04",
        ),
        (
            COMMANDS,
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "(verl's name); did you mean optimizer.lr? Write",
        ),
        (("grpo", "ppo"), "data.train_batch_size=256", "did you mean trainer.prompts_per_step? Write"),
        (("sft", "dpo", "rm"), "data.train_batch_size=256", "did you mean trainer.batch_size? Write"),
        (COMMANDS, "output_dir=out", "did you mean --output-dir? Pass --output-dir out instead."),
        (COMMANDS, "dataset_name=trl-lib/Capybara", "did you mean data.train_files? Write"),
    ],
)
def test_a_foreign_name_points_at_the_commands_field(commands, override, message) -> None:
    name = override.partition("=")[0]
    for command in commands:
        with pytest.raises(ConfigError) as caught:
            load(command, override)
        assert str(caught.value).startswith(f"unknown option {name} (")
        assert message in str(caught.value), (command, str(caught.value))


def test_the_same_pointer_for_a_config_file_and_none_where_the_command_has_no_such_field(tmp_path) -> None:
    written = tmp_path / "run.yaml"
    written.write_text("learning_rate: 2.0e-5\ntrainer:\n  total_epochs: 3\n")
    with pytest.raises(
        ConfigError, match=r"^unknown option learning_rate \(TRL's name\); did you mean optimizer"
    ):
        load("sft", config_file=str(written))
    with pytest.raises(ConfigError, match=r"^unknown option beta; known options: \["):
        load("sft", "beta=0.1")  # SFT has no beta: the usual message


def test_every_field_named_exists_in_a_command_and_no_foreign_name_is_a_field() -> None:
    classes = [config_class(command) for command in COMMANDS]
    for name, foreign in FOREIGN_NAMES.items():
        for target in foreign.fields:
            assert target.startswith("--") or any(has_field(c, target) for c in classes), (name, target)
        assert not any(has_field(c, name) for c in classes), f"{name} is a field: it needs no pointer"
