"""``drivetrain grpo model.path=builtin:multistep rollout.name=vllm``: the embedded chat task on vLLM, whose prompts
share a system prefix of over two 128-token KV blocks and come back every step; after each hand-off of weights
that changed, vLLM's log-probs of those prompts' responses are still the actor's (KV blocks of the old weights kept
for the shared prefix would serve the old policy's numbers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

# A reward that differs within every group, so that each step's update changes the weights (the task's own reward
# scores the barely warmed-up model's malformed answers -1 alike, and equal rewards leave the policy as it was).
LENGTH_REWARD = (
    "def by_length(*, prompts, completions, references):\n    return [len(c) / 10 for c in completions]\n"
)


def test_grpo_on_the_chat_task_keeps_vllms_log_probs_the_actors_across_hand_offs(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    run = tmp_path / "run"
    trainer = ["warm_start_steps=2", "warm_start_batch_size=2", "total_steps=3", "prompts_per_step=2"]
    trainer += ["eval_every=0", "eval_samples=2", "save_every=0", "progress_bar=false"]
    overrides = ["model.path=builtin:multistep", "rollout.name=vllm", "rollout.max_new_tokens=16"]
    overrides += [f"algorithm.reward_function={reward}:by_length", *(f"trainer.{t}" for t in trainer)]
    overrides += ["data.generated_train_size=2", "data.generated_val_size=2"]
    command = [sys.executable, "-m", "drivetrain_engine_core", "grpo", "--output-dir", str(run), *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [
        row
        for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "train/reward" in row
    ]
    assert [row["step"] for row in steps] == [1, 2, 3]
    # Step 2 samples from updated weights handed over whole, step 3 from a delta on them that changed them again.
    handed = [(row["rollout/sync_delta"], row["rollout/sync_fraction_changed"] > 0) for row in steps[:2]]
    assert handed == [(0.0, True), (1.0, True)]
    assert max(row["rollout/log_prob_diff_max"] for row in steps) < 1e-5, steps
