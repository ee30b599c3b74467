"""GRPO through one colocated Ray worker group (world 2): actor, reference and rollout on the same workers.

One Ray launch checks: one colocated GRPO step on the same samples and rewards as the single-process path
reports the same loss and grad norm (1e-5 rel); after the hand-off inside the workers, every worker's rollout
serves the new version and its log-probs equal the actor's (gap < 1e-5); the rollout sleeps while parts run
and wakes to generate; a failed call and a dead worker are one ``WorkerGroupError`` naming the rank and part.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_roles.grpo.config import load_config
from drivetrain_roles.grpo.controller import ColocatedGRPO, colocated_spec
from drivetrain_roles.grpo.rewards import group_advantages
from drivetrain_roles.grpo.step import RolloutBatch, log_prob_gap, update
from drivetrain_roles.grpo.trainer import GRPOTrainer
from drivetrain_roles.jobs.data import Example
from drivetrain_roles.jobs.default_assets import (
    arithmetic_examples,
    build_arithmetic_tokenizer,
    write_model_dir,
)
from drivetrain_roles.workers import ColocatedWorkerGroup, WorkerGroupError

N, KL_COEF = 4, 0.1
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()


def _config(model_dir):
    overrides = [
        f"model.path={model_dir}",
        "engine.micro_batch.micro_batch_size=3",
        "engine.micro_batch.max_tokens=null",
        f"rollout.n={N}",
        "rollout.temperature=0.8",
        "rollout.max_new_tokens=4",
        f"algorithm.kl_loss_coef={KL_COEF}",
        # One optimizer step per rollout: with several shuffled mini-batches, two data-parallel workers cut
        # their shares differently from one process, so the updates are not comparable step for step.
        "algorithm.ppo_mini_batches=1",
        "trainer.prompts_per_step=4",
    ]
    return load_config(None, overrides)


def _examples(tokenizer, count):
    return [
        Example(
            prompt_ids=tokenizer(e["prompt"])["input_ids"],
            response_ids=[],
            prompt_text=e["prompt"],
            response_text=e["response"],
        )
        for e in arithmetic_examples(count, seed=1)
    ]


def _with_rewards(samples: RolloutBatch) -> RolloutBatch:
    """The untrained model is never right: give the groups rewards, so that the update is not zero."""
    advantages = group_advantages(REWARDS, N)
    offsets = samples.batch["input_ids"].offsets()
    samples.batch["advantages"] = torch.nested.nested_tensor_from_jagged(
        torch.repeat_interleave(advantages, offsets.diff()), offsets=offsets
    )
    return RolloutBatch(samples.batch, samples.rollout_log_probs, REWARDS, samples.response_lengths)


@pytest.mark.slow
def test_colocated_grpo_step_matches_single_process_and_fails_clearly(ray_cluster, tmp_path) -> None:
    model_dir = write_model_dir(tmp_path / "model", seed=3)
    tokenizer = build_arithmetic_tokenizer()
    config = _config(model_dir)
    examples = _examples(tokenizer, 4)
    group = ColocatedWorkerGroup(colocated_spec(config), world_size=2, num_cpus_per_worker=0.5, timeout_s=120)
    with ColocatedGRPO(group, config, tokenizer) as grpo:
        assert sorted(group.topologies) == ["actor", "reference"]
        assert [s["rollout_asleep"] for s in group.states()] == [True, True]
        samples = _with_rewards(grpo.sample(0, examples))
        assert [s["rollout_asleep"] for s in group.states()] == [False, False]
        batch = samples.batch.clone()
        metrics = grpo.update(samples)
        # Parts ran with the rollout asleep; the rollout served the start weights, as the actor computed them.
        assert [s["rollout_asleep"] for s in group.states()] == [True, True]
        assert metrics["rollout/log_prob_diff_max"] < 1e-5
        assert group.sync_rollout(1) == 1
        assert [s["rollout_version"] for s in group.states()] == [1, 1]
        after = grpo.sample(1, examples)
        served = group.call("actor", "compute_log_prob", after.batch)["log_probs"]
        assert log_prob_gap(after.batch, served, after.rollout_log_probs) < 1e-5
        with pytest.raises(
            WorkerGroupError, match=r"reference\.no_such_method failed on rank \d: .*Reference"
        ):
            group.call("reference", "no_such_method", after.batch)
        with pytest.raises(KeyError, match="no part 'critic'"):
            group.call("critic", "compute_values", after.batch)
        ray_cluster.kill(group.actors[1])
        with pytest.raises(
            WorkerGroupError, match=r"actor\.compute_log_prob failed on rank 1: The actor died"
        ):
            group.call("actor", "compute_log_prob", after.batch)
    # The single-process path on the same samples and rewards.
    trainer = GRPOTrainer(config, tmp_path / "run")
    actor = trainer.make_actor(str(model_dir))
    expected = update(
        actor, trainer.make_reference(actor, str(model_dir)), RolloutBatch(batch, *_rest(samples))
    )
    loss = metrics["pg_loss"] + KL_COEF * metrics["kl_loss"]
    assert loss == pytest.approx(expected["pg_loss"] + KL_COEF * expected["kl_loss"], rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert expected["grad_norm"] > 0


def _rest(samples: RolloutBatch) -> tuple:
    return samples.rollout_log_probs, samples.rewards, samples.response_lengths
