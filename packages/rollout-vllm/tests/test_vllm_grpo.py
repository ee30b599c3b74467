"""``drivetrain grpo rollout.name=vllm`` end to end in the vLLM environment: a few steps on a tiny model vLLM
can serve, checkpointed and resumed, a clean exit (vLLM's own teardown used to print a traceback after the
run's last line), and the rollout's log-probs agree with the actor's every step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def grpo(run, model, total_steps, *extra):
    command = [sys.executable, "-m", "drivetrain_engine_core", "grpo", "--output-dir", str(run), *extra]
    overrides = [f"model.path={model}", "rollout.name=vllm", "rollout.max_new_tokens=8"]
    overrides += [f"trainer.total_steps={total_steps}", "trainer.save_every=2", "trainer.eval_every=2"]
    return subprocess.run(
        [*command, *overrides, "trainer.progress_bar=false"], capture_output=True, text=True, timeout=400
    )


def test_grpo_on_vllm_runs_resumes_and_exits_cleanly(servable_model_dir, tmp_path):
    run = tmp_path / "run"
    first = grpo(run, servable_model_dir, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = grpo(run, servable_model_dir, 4, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for done in (first, resumed):
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in steps if "rollout/log_prob_diff_max" in row]
    assert [row["step"] for row in trained] == [1, 2, 3, 4]
    assert max(row["rollout/log_prob_diff_max"] for row in trained) < 1e-5
    assert (run / "final_model" / "config.json").exists()
