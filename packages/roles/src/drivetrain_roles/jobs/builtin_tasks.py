"""The embedded tasks: what ``model.path=builtin:<name>`` selects, one entry each.

A task is a tiny model with its own tokenizer, the data written for it under the run folder (when
``data.train_files`` is empty) and the settings that suit the two (its reward, lengths, run length): each command's
preset named by the task's ``model.path``, laid under the user's file and overrides (``--print-config`` names it). Jobs ask this registry; none tests a task's name.

NOTE: one setting names the task, ``model.path``, rather than a ``data.task`` beside it: the embedded model is
made for its task (its tokenizer knows the task's characters, its positions fit the task's lengths), so the two
cannot be chosen apart, and a resume is already checked against the ``model.path`` its run started from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import calculator_task, multistep_task
from .default_assets import BUILTIN_MODEL, write_arithmetic_data, write_model_dir

BUILTIN_PREFIX = "builtin:"

Sections = Mapping[str, Mapping[str, Any]]
"""``{section: {key: value}}``, as a preset holds them."""


@dataclass(kw_only=True, frozen=True)
class BuiltinTask:
    """One embedded task.

    Attributes:
        model_path: the ``model.path`` that selects it (``builtin:<name>``).
        write_model: ``write_model(directory, seed)`` writes the untrained model and its tokenizer.
        write_data: ``write_data(directory, train_size=, val_size=, seed=)`` writes ``train.jsonl`` and
            ``val.jsonl`` and returns their paths.
        defaults: per command (``sft``, ``grpo``, ``ppo``, ...), the values that differ from the command's own
            defaults for this task: the command's preset ``<model_path>`` (each applies unless set).
    """

    model_path: str
    write_model: Callable[[Path, int], Path]
    write_data: Callable[..., tuple[Path, Path]]
    defaults: Mapping[str, Sections] = field(default_factory=dict)


ARITHMETIC = BuiltinTask(
    model_path=BUILTIN_MODEL,
    write_model=lambda path, seed: write_model_dir(path, seed=seed),
    write_data=write_arithmetic_data,
)
"""Addition questions (``"12+7="`` -> ``"19"``) for a 0.1 M-parameter model; the commands' defaults are its."""

_MULTISTEP_DATA: dict[str, Any] = {
    "messages_key": "messages",
    "max_length": 512,
    "generated_val_size": 100,
}
_MULTISTEP_ROLLOUT: Sections = {
    # NOTE: fewer training problems than a run samples (60 x 8 = 480): each comes back, as in real RL runs' epochs.
    "data": {**_MULTISTEP_DATA, "generated_train_size": 200},
    "rollout": {"max_new_tokens": 96},
    "algorithm": {"reward_function": multistep_task.REWARD_FUNCTION},
    "trainer": {
        "warm_start_steps": 200,
        "warm_start_batch_size": 16,
        "total_steps": 60,
        "prompts_per_step": 8,
        "eval_every": 20,
        "eval_samples": 100,
    },
}

MULTISTEP = BuiltinTask(
    model_path=BUILTIN_PREFIX + multistep_task.NAME,
    write_model=multistep_task.write_multistep_model,
    write_data=multistep_task.write_multistep_data,
    defaults={
        "sft": {
            "data": _MULTISTEP_DATA,
            "trainer": {"max_new_tokens": 96, "total_steps": 500, "batch_size": 16, "eval_samples": 100},
        },
        "grpo": _MULTISTEP_ROLLOUT,
        "ppo": _MULTISTEP_ROLLOUT,
    },
)
"""Chains of 2-4 operations worked step by step in a chat template (:mod:`.multistep_task`)."""

_CALCULATOR_DATA: dict[str, Any] = {"messages_key": "messages", "max_length": 256, "generated_val_size": 100}
_CALCULATOR_ROLLOUT: Sections = {
    # NOTE: the warm start learns from ``mixed`` rows (half call the tool, half guess in the head), so it calls the
    # tool in about half its samples; the episodes still start from ``messages``' prompt. GRPO then learns to call
    # it: the tool-use warm start alone copied the question exactly too rarely for GRPO's 0/1 reward to move it
    # (held-out 0.23 -> 0.20 in 150 steps, README figures).
    "data": {**_CALCULATOR_DATA, "messages_key": "mixed", "generated_train_size": 400},
    # A call is 22 tokens with its turn end; the answer 8.
    "rollout": {"max_new_tokens": 32},
    "environment": {"name": calculator_task.NAME, "max_turns": 3, "max_total_tokens": 256},
    # NOTE: the environment's reward is the task's (1 for the row's answer), so no function is added to it:
    # exact_match beside it paid a right answer twice on tool rows and never on guess rows, whose reference is
    # the guess (``Guess <expression> = <value>``, which it paid 1 when copied), so val/reward read 2 at
    # accuracy 1. Alone it is a fraction, val/accuracy's number.
    "algorithm": {"reward_function": None, "reward_functions": []},
    "trainer": {
        # NOTE: 1,000 steps learn to copy the question into a call (400 miscopied 76 of 100 held-out calls).
        "warm_start_steps": 1000,
        "warm_start_batch_size": 16,
        "total_steps": 40,
        "prompts_per_step": 8,
        "eval_samples": 100,
    },
}

CALCULATOR = BuiltinTask(
    model_path=BUILTIN_PREFIX + calculator_task.NAME,
    write_model=calculator_task.write_calculator_model,
    write_data=calculator_task.write_calculator_data,
    defaults={
        "sft": {
            "data": _CALCULATOR_DATA,
            "trainer": {"max_new_tokens": 48, "total_steps": 1000, "batch_size": 16, "eval_samples": 100},
        },
        "grpo": _CALCULATOR_ROLLOUT,
        "ppo": _CALCULATOR_ROLLOUT,
    },
)
"""Multi-digit arithmetic answered with the ``calculator`` tool (:mod:`.calculator_task`)."""

BUILTIN_TASKS: dict[str, BuiltinTask] = {
    task.model_path: task for task in (ARITHMETIC, MULTISTEP, CALCULATOR)
}
"""Every embedded task by the ``model.path`` that selects it."""


def builtin_task(model_path: str) -> BuiltinTask | None:
    """The embedded task ``model_path`` selects, or ``None`` for any other model."""
    return BUILTIN_TASKS.get(model_path)


def data_task(model_path: str) -> BuiltinTask:
    """The task whose data a run without ``data.train_files`` generates: its embedded model's, else arithmetic."""
    return BUILTIN_TASKS.get(model_path, ARITHMETIC)
