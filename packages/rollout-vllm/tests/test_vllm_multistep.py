"""``drivetrain grpo model.path=builtin:multistep rollout.name=vllm``: the embedded chat task on vLLM, whose prompts
share a system prefix of over two 128-token KV blocks and come back every step; after each hand-off of weights
that changed, vLLM's log-probs of those prompts' responses are still the actor's (KV blocks of the old weights kept
for the shared prefix would serve the old policy's numbers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def test_grpo_on_the_chat_task_keeps_vllms_log_probs_the_actors_across_hand_offs(
    tmp_path, chat_task_overrides, chat_task_steps
):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "drivetrain_engine_core", "grpo", "--output-dir", str(run)]
    done = subprocess.run(
        [*command, *chat_task_overrides, "rollout.name=vllm"], capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = chat_task_steps(run)
    assert max(row["rollout/log_prob_diff_max"] for row in steps) < 1e-5, steps


def test_adapter_only_grpo_on_vllm_samples_as_the_lora_actor(tmp_path, chat_task_overrides, chat_task_steps):
    """``model.lora`` with ``rollout.lora_handoff=adapter``: each step hands vLLM the adapters alone, served as an
    adapter of their own per version, the first one verified by reading vLLM's adapter back; vLLM's log-probs of
    the shared-prefix prompts are the LoRA actor's every step."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "drivetrain_engine_core", "grpo", "--output-dir", str(run)]
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "rollout.lora_handoff=adapter"]
    lora += ["rollout.options.enable_lora=true", "rollout.options.max_lora_rank=8"]
    done = subprocess.run(
        [*command, *chat_task_overrides, "rollout.name=vllm", *lora],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = chat_task_steps(run)
    assert max(row["rollout/log_prob_diff_max"] for row in steps) < 1e-5, steps
    assert steps[0]["rollout/sync_verified"] == 1.0
    assert all(row["rollout/sync_bytes"] < 20_000 for row in steps), steps  # the adapters alone: 14 KiB
