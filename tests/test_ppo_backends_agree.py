"""Cross-backend agreement of PPO: an actor and a critic on Megatron and on FSDP, built by name, give the same
curve (actor loss and grad norm, critic loss and grad norm, explained variance) over 5 PPO steps on the same
batches and scores (single process, fp32)."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig, create_engine, engine_config_from_dict
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch

pytestmark = pytest.mark.slow
pytest.importorskip("drivetrain_engine_fsdp")
pytest.importorskip("drivetrain_engine_megatron")

STEPS = 5
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0)
CURVE = ("pg_loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/vf_explained_var")


def _engine(backend: str, path: str, model_type: str):
    engine = create_engine(
        model_config=ModelConfig(path=path, model_type=model_type),
        engine_config=engine_config_from_dict(
            {"backend": backend, "micro_batch": MicroBatchConfig(micro_batch_size=2)}
        ),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    return engine


def _curve(backend: str, policy: str, value_model: str) -> list[dict[str, float]]:
    from drivetrain_roles.actor import Actor, ActorConfig
    from drivetrain_roles.critic import Critic, CriticConfig
    from drivetrain_roles.mini_batches import UpdateSchedule
    from drivetrain_roles.ppo.config import load_config
    from drivetrain_roles.ppo.step import update
    from drivetrain_roles.rl.batch import RolloutBatch

    algorithm = load_config(
        None, ["algorithm.use_kl_in_reward=false", "algorithm.lam=0.9", "algorithm.ppo_mini_batches=1"]
    ).algorithm
    schedule = UpdateSchedule(mini_batch_size=4, epochs=2, seed=3)
    actor = Actor(_engine(backend, policy, "language_model"), ActorConfig(schedule=schedule))
    critic = Critic(
        _engine(backend, value_model, "value_model"),
        CriticConfig(loss=algorithm.value_loss(), schedule=schedule),
    )
    curve = []
    for step in range(STEPS):
        batch = random_batch(
            vocab_size=100, prompt_lengths=[2, 4, 3, 5], response_lengths=[5, 3, 4, 2], seed=step
        )
        scores = torch.tensor([1.0, 0.0, 0.5, -1.0]).roll(step)
        no_rollout = [torch.zeros(int(m.sum())) for m in batch["loss_mask"].unbind()]
        samples = RolloutBatch(
            batch=batch, rollout_log_probs=no_rollout, rewards=scores, response_lengths=[5, 3, 4, 2]
        )
        metrics = update(actor, None, critic, samples, algorithm, 0.0, train_actor=step > 0)
        curve.append({name: metrics.get(name, 0.0) for name in CURVE})
    return curve


def test_ppo_on_megatron_matches_fsdp_over_five_steps(tmp_path):
    policy = str(make_tiny_model_dir(tmp_path / "policy", arch="qwen2"))
    value_model = str(
        make_tiny_model_dir(tmp_path / "critic", arch="qwen2", model_type="value_model", seed=1)
    )
    megatron, fsdp = _curve("megatron", policy, value_model), _curve("fsdp", policy, value_model)
    assert fsdp[1]["grad_norm"] > 0 and fsdp[-1]["critic/grad_norm"] > 0
    for step, (theirs, ours) in enumerate(zip(megatron, fsdp, strict=True)):
        for name in CURVE:
            assert theirs[name] == pytest.approx(ours[name], rel=1e-4, abs=1e-6), (step, name)
