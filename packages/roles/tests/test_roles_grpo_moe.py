"""``drivetrain grpo`` on the tiny Qwen3-MoE (4 experts, top-2), with and without router replay (R3).

Numbers, not "it ran": the rollout's log-probs equal the actor's recomputed ones every step (the hand-off of
fused experts is exact, and so is the replay of the rollout's routing); replaying routes that the actor would
choose anyway changes no number of the run; the reported router balance metric of the first update is the
mean over its sequences of transformers' own ``load_balancing_loss_func`` on each sequence alone. The same
run with R3 on the Megatron engine gives the FSDP engine's numbers.
"""

from __future__ import annotations

import json

import pytest
import torch
from drivetrain_engine_core.kit import NOT_RECORDED, ROUTED_EXPERTS
from drivetrain_engine_core.testing import make_tiny_model_dir
from drivetrain_roles.grpo import step as grpo_step
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.trainer import GRPOTrainer
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

STEPS = 2
REWARDS = (
    "def length(*, prompts, completions, references):\n    return [float(len(c)) for c in completions]\n"
)


def run_grpo(model_dir, run, router_replay, monkeypatch, backend="fsdp"):
    """Two GRPO steps on ``model_dir``, rewarding longer answers; returns the per-step metrics and each step's
    actor batch."""
    batches = []
    run.mkdir()
    (run / "rewards.py").write_text(REWARDS)

    def capture(*args, **kwargs):
        samples = original(*args, **kwargs)
        batches.append(samples.batch.clone())
        return samples

    original = grpo_step.rollout_batch
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"rollout.router_replay={router_replay}",
            f"engine.backend={backend}",
            "rollout.n=2",
            "rollout.max_new_tokens=4",
            "optimizer.lr=0.05",
            "algorithm.ppo_mini_batches=1",
            f"algorithm.reward_function={run / 'rewards.py'}:length",
            "engine.micro_batch.micro_batch_size=2",
            "engine.micro_batch.max_tokens=null",
            *(
                f"trainer.{v}"
                for v in (f"total_steps={STEPS}", "prompts_per_step=2", "eval_every=0", "save_every=0")
            ),
            "trainer.progress_bar=false",
        ],
    )
    with monkeypatch.context() as patch:
        patch.setattr(grpo_step, "rollout_batch", capture)
        GRPOTrainer(config, run).run()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "train/reward" in r], batches


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")


def test_grpo_on_moe_with_and_without_router_replay(model_dir, tmp_path, monkeypatch):
    live, live_batches = run_grpo(model_dir, tmp_path / "live", "disabled", monkeypatch)
    replayed, replay_batches = run_grpo(model_dir, tmp_path / "r3", "R3", monkeypatch)
    assert len(live) == len(replayed) == STEPS
    assert all(step["train/grad_norm"] > 0 for step in live)  # the groups' rewards differ: the policy moves
    assert all(ROUTED_EXPERTS not in b for b in live_batches)
    for batch in replay_batches:
        routes = batch[ROUTED_EXPERTS]
        assert routes.values().shape[1:] == (2, 2)  # layers x top-2, one row per token
        ends = batch["input_ids"].offsets()[1:] - 1
        assert (routes.values()[ends] == NOT_RECORDED).all()  # each sequence's last token
    for step in replayed + live:
        assert step["rollout/log_prob_diff_max"] < 1e-5
    # The actor would route every token as the rollout did, so replaying that routing changes no number (the
    # forward is the same bit for bit; the router's gradient goes through a gather instead of top-k's backward,
    # which sums in another order: the grad norm moves by about 3e-7 relative).
    for a, b in zip(live, replayed, strict=True):
        for key in ("train/reward", "train/pg_loss", "train/grad_norm", "train/router_aux_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    # The first update's balance metric: transformers' aux loss of each sequence alone, averaged.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    per_sequence = []
    for sequence in live_batches[0]["input_ids"].unbind():
        with torch.no_grad():
            logits = model(input_ids=sequence[None], output_router_logits=True).router_logits
        per_sequence.append(load_balancing_loss_func(logits, num_experts=4, top_k=2))
    expected = float(torch.stack(per_sequence).mean())
    assert live[0]["train/router_aux_loss"] == pytest.approx(expected, rel=1e-5)
    # R3 on Megatron (megatron-core's RouterReplay): the same run as on FSDP.
    megatron, _ = run_grpo(model_dir, tmp_path / "r3-megatron", "R3", monkeypatch, backend="megatron")
    for a, b in zip(replayed, megatron, strict=True):
        assert b["rollout/log_prob_diff_max"] < 1e-5
        for key in ("train/reward", "train/pg_loss", "train/grad_norm", "train/router_aux_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    # The final model (an export in checkpoint layout, experts one tensor each) loads whole.
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "r3" / "final_model", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
