"""The documented starting files (``drivetrain_roles/<command>/example.yaml``) pin nothing that follows the model.

A user copies the file and edits ``model.path``: every value the file sets then applies to their model. The files
set ``optimizer.lr: 3.0e-3`` and ``data.max_length: 32`` (the tiny embedded task's), so a user's model trained
at 3e-3 with every example cut at 32 tokens, silently, where ``model.path`` alone gives it verl's and TRL's values.
"""

from __future__ import annotations

from importlib import import_module
from importlib.resources import files

import pytest
from drivetrain_roles.jobs.builtin_tasks import BUILTIN_TASKS

COMMANDS = ("sft", "dpo", "rm", "grpo", "ppo")


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> str:
    """A tiny model saved locally, not the embedded one (what a user points ``model.path`` at)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("models") / "my-gpt2"
    GPT2LMHeadModel(
        GPT2Config(
            n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=1
        )
    ).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("command", COMMANDS)
def test_editing_only_the_model_path_of_an_example_file_gives_that_models_values(command, user_model) -> None:
    load = import_module(f"drivetrain_roles.{command}.config").load_config
    example = str(files(f"drivetrain_roles.{command}").joinpath("example.yaml"))
    for model in (user_model, *BUILTIN_TASKS):
        assert load(example, [f"model.path={model}"]) == load(None, [f"model.path={model}"]), model
    mine = load(example, [f"model.path={user_model}"])
    assert mine.optimizer.lr <= 1e-5 and mine.data.max_length == 1024  # not the embedded task's 3e-3 and 32
