"""PPO through one colocated Ray worker group (world 2): actor, critic, reference and rollout on the same workers.

One Ray launch checks: on the same samples and scores, one colocated PPO step (GAE and whitening on the driver)
reports the actor's and the critic's losses and grad norms of the single-process update within 1e-5 (rel), and
the hand-off leaves every worker serving the new version.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_roles.jobs.default_assets import (
    build_arithmetic_tokenizer,
    write_model_dir,
)
from drivetrain_roles.ppo.config import load_config
from drivetrain_roles.ppo.controller import ColocatedPPO, colocated_spec
from drivetrain_roles.ppo.step import update
from drivetrain_roles.ppo.trainer import PPOTrainer
from drivetrain_roles.rl.batch import RolloutBatch
from drivetrain_roles.workers import ColocatedWorkerGroup

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
COMPARED = ("pg_loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "kl", "critic/vf_explained_var")


@pytest.mark.slow
def test_colocated_ppo_step_matches_single_process(ray_cluster, tmp_path, arithmetic_prompts) -> None:
    model_dir = write_model_dir(tmp_path / "model", seed=3)
    tokenizer = build_arithmetic_tokenizer()
    overrides = [
        f"model.path={model_dir}",
        "engine.micro_batch.micro_batch_size=2",
        "engine.micro_batch.max_tokens=null",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "trainer.prompts_per_step=4",
        "algorithm.ppo_mini_batches=1",  # several shuffled mini-batches cut the ranks' shares differently
        "algorithm.kl_ctrl.kl_coef=0.1",
    ]
    config = load_config(None, overrides)
    examples = arithmetic_prompts(tokenizer, 4)
    spec = colocated_spec(config, tmp_path / "critic_start")
    group = ColocatedWorkerGroup(spec, world_size=2, num_cpus_per_worker=0.5, timeout_s=180)
    with ColocatedPPO(group, config, tokenizer) as ppo:
        assert sorted(group.topologies) == ["actor", "critic", "reference"]
        samples = ppo.sample(0, examples)
        samples = RolloutBatch(samples.batch, samples.rollout_log_probs, SCORES, samples.response_lengths)
        batch = samples.batch.clone()
        metrics = ppo.update(samples)
        group.sync_rollout(1)
        assert [s["rollout_version"] for s in group.states()] == [1, 1]
    trainer = PPOTrainer(config, tmp_path / "run")
    actor = trainer.actor = trainer.make_actor(str(model_dir))
    expected = update(
        actor,
        trainer.make_reference(actor, str(model_dir)),
        trainer.make_critic(str(model_dir)),
        RolloutBatch(batch, samples.rollout_log_probs, SCORES, samples.response_lengths),
        config.algorithm,
        0.1,
        train_actor=True,
    )
    assert expected["grad_norm"] > 0 and expected["critic/grad_norm"] > 0
    for name in COMPARED:
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name
