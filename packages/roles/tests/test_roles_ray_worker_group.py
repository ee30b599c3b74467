"""The Ray worker group: dispatch/gather order without Ray, and a 2-worker actor group against references.

The Ray tests check that log-probs computed by two Ray workers (balanced shards, gathered back) equal a plain
Hugging Face model's in the original order, and that one policy update through the group reports the same
loss and gradient norm as the same update in this process on the whole batch.
"""

from __future__ import annotations

import sys

import pytest
import torch
from drivetrain_engine_core.backend import BatchError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, engine_config_from_dict, jagged
from drivetrain_engine_core.testing import make_tiny_model_dir, random_batch, reference_log_probs
from drivetrain_roles.actor import Actor, ActorConfig
from drivetrain_roles.losses import PolicyLossConfig
from drivetrain_roles.mini_batches import UpdateSchedule
from drivetrain_roles.workers import (
    DispatchPlan,
    RayWorkerGroup,
    WorkerGroupError,
    WorkerSpec,
    WorkerTopology,
    check_topology,
    cluster_shortfall,
    require_ray,
)
from tensordict import TensorDict

VOCAB = 100
ACTOR_CONFIG = ActorConfig(
    loss=PolicyLossConfig(clip_ratio_low=0.05, clip_ratio_high=0.05),
    schedule=UpdateSchedule(mini_batch_size=6, shuffle=False),
)
OPTIMIZER = OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=None)


def test_dispatch_shards_by_dp_rank_and_gathers_in_original_order() -> None:
    # 2 data-parallel ranks x 2 tensor-parallel peers; the first peer of each dp rank is its output rank.
    workers = [WorkerTopology(rank=r, dp_rank=r // 2, dp_size=2, is_output_rank=r % 2 == 0) for r in range(4)]
    batch = random_batch(
        vocab_size=VOCAB, prompt_lengths=[1, 9, 2, 8, 3, 7], response_lengths=[1] * 6, seed=0
    )
    batch["row"] = torch.arange(6)
    plan = DispatchPlan.for_batch(batch, workers)
    shards = plan.shards()
    assert torch.equal(shards[0]["row"], shards[1]["row"]) and torch.equal(shards[2]["row"], shards[3]["row"])
    assert sorted(torch.cat([shards[0]["row"], shards[2]["row"]]).tolist()) == list(range(6))
    assert shards[0]["row"].tolist() != [0, 1, 2], "balanced sharding should not be contiguous for this batch"
    # Workers answer with 10 * row; non-output ranks answer garbage that must be ignored.
    answers = [
        TensorDict({"y": shard["row"] * 10 if w.is_output_rank else -torch.ones(3)}, batch_size=[3])
        for w, shard in zip(workers, shards, strict=True)
    ]
    assert plan.gather(answers)["y"].tolist() == [0, 10, 20, 30, 40, 50]
    metrics = [{"loss": float(w.rank)} for w in workers]
    assert plan.gather(metrics) == {"loss": 0.0}


def test_a_padded_batch_is_dispatched_without_padding_and_answered_padded() -> None:
    """The roles take verl's padded (B, L) batches in-process, but a worker group's dispatch read jagged
    offsets and failed on them (AttributeError). Shards travel in no-padding form; per-token answers come
    back as (B, L) with zeros at padding, as the roles answer in-process."""
    workers = [WorkerTopology(rank=r, dp_rank=r, dp_size=2, is_output_rank=True) for r in range(2)]
    input_ids = torch.tensor(
        [[0, 0, 5, 6, 7, 0], [0, 8, 9, 10, 11, 12], [13, 14, 15, 0, 0, 0], [0, 0, 0, 16, 17, 18]]
    )
    attention_mask = input_ids > 0
    batch = TensorDict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": attention_mask},
        batch_size=[4],
    )
    plan = DispatchPlan.for_batch(batch, workers)
    shards = plan.shards()
    assert sorted(len(shard) for shard in shards) == [2, 2]
    answers = [
        TensorDict(
            {"y": jagged(shard["input_ids"].values() * 10, shard["input_ids"].offsets())},
            batch_size=[len(shard)],
        )
        for shard in shards
    ]
    assert torch.equal(plan.gather(answers)["y"], input_ids * 10 * attention_mask)


def test_dispatch_errors_name_the_problem() -> None:
    two = [WorkerTopology(rank=r, dp_rank=r, dp_size=2, is_output_rank=True) for r in range(2)]
    with pytest.raises(BatchError, match="cannot be split evenly over dp_size=2"):
        DispatchPlan.for_batch(
            random_batch(vocab_size=VOCAB, prompt_lengths=[2] * 3, response_lengths=[1] * 3, seed=0), two
        )
    with pytest.raises(ValueError, match="exactly one output rank"):
        check_topology([WorkerTopology(rank=r, dp_rank=0, dp_size=1, is_output_rank=True) for r in range(2)])
    with pytest.raises(ValueError, match="disagree on data_parallel_size"):
        check_topology([two[0], WorkerTopology(rank=1, dp_rank=0, dp_size=1, is_output_rank=True)])


def test_a_batch_the_ranks_do_not_divide_is_dispatched_unevenly_when_asked() -> None:
    """The error said to pass ``uneven=True``, which no worker group took: a batch left at 10 sequences by
    filtering could not be dispatched over 4 data-parallel ranks at all."""
    four = [WorkerTopology(rank=r, dp_rank=r, dp_size=4, is_output_rank=True) for r in range(4)]
    batch = random_batch(vocab_size=VOCAB, prompt_lengths=[2] * 10, response_lengths=[1] * 10, seed=0)
    with pytest.raises(BatchError, match="cannot be split evenly over dp_size=4"):
        DispatchPlan.for_batch(batch, four)
    plan = DispatchPlan.for_batch(batch, four, uneven=True)
    assert sorted(len(shard) for shard in plan.shards()) == [2, 2, 3, 3]
    assert sorted(torch.cat(plan.indices).tolist()) == list(range(10))


def test_a_request_the_cluster_cannot_place_is_named_up_front() -> None:
    """Three 1-CPU workers on a 2-CPU cluster waited out the setup deadline, then reported every rank as dead or
    stuck in a collective; a group now warns first (not refuses: an autoscaling cluster may grow)."""
    assert cluster_shortfall({"CPU": 0.5, "GPU": 0.0}, 3, {"CPU": 2.0}) is None
    shortfall = cluster_shortfall({"CPU": 1.0, "GPU": 0.0}, 3, {"CPU": 2.0})
    assert (
        shortfall is not None and "3 workers x num_cpus_per_worker=1.0 need 3 CPUs, but the Ray" in shortfall
    )
    gpus = cluster_shortfall({"CPU": 1.0, "GPU": 1.0}, 2, {"CPU": 8.0, "GPU": 1.0})
    assert gpus is not None and "need 2 GPUs, but the Ray cluster has 1" in gpus


def test_a_fractional_gpu_per_worker_is_refused_for_several_workers() -> None:
    """Ray may place two ranks of one group on one GPU, which NCCL refuses ("Duplicate GPU detected")."""
    engine = engine_config_from_dict({"backend": "fsdp", "device": "cuda"})
    spec = WorkerSpec(role="actor", model_config=ModelConfig(path="/unused"), engine_config=engine)
    with pytest.raises(ValueError, match=r"num_gpus_per_worker=0.5 for 2 workers: Ray may place two ranks"):
        RayWorkerGroup(spec, world_size=2, num_gpus_per_worker=0.5)


class _FakeRay:
    """Ray's ``wait``/``get`` over plain values: a ref is its result, or the exception it raises; ``running``
    refs never finish."""

    def wait(self, pending, num_returns, timeout):
        done = [ref for ref in pending if ref != "running"]
        return done[:num_returns], [ref for ref in pending if ref not in done[:num_returns]]

    def get(self, ref):
        if isinstance(ref, Exception):
            raise ref
        return ref


def test_a_group_whose_call_failed_refuses_the_next_call() -> None:
    """After one rank failed, its peers may still be inside that call's collectives, where the next call's first
    collective would pair with theirs (another error, or silently wrong reductions)."""
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group._ray, group._broken, group.timeout_s = _FakeRay(), None, 5.0
    # Every rank failing at once (a missing method) leaves no rank inside the call: the group stays usable.
    with pytest.raises(WorkerGroupError, match=r"no_such_method failed on rank 0"):
        group._wait([AttributeError("no_such_method"), AttributeError("no_such_method")], "no_such_method")
    assert group._wait([1, 2], "compute_log_prob") == [1, 2]
    with pytest.raises(WorkerGroupError, match=r"update_policy failed on rank 1: out of memory"):
        group._wait(["running", RuntimeError("out of memory")], "update_policy")
    with pytest.raises(
        WorkerGroupError, match=r"compute_log_prob: this worker group is broken .*shutdown\(\) it"
    ):
        group._wait([1, 2], "compute_log_prob")


def test_missing_ray_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'drivetrain-roles\[ray\]'"):
        require_ray()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("ray"), arch="llama", vocab_size=VOCAB, with_tokenizer=False
    )


def rollout_batch(model_dir) -> TensorDict:
    """Six sequences of uneven length with old log-probs near the model's own and random advantages."""
    batch = random_batch(
        vocab_size=VOCAB, prompt_lengths=[3, 9, 2, 4, 8, 1], response_lengths=[5, 2, 7, 3, 5, 6], seed=3
    )
    offsets = batch["input_ids"].offsets()
    generator = torch.Generator().manual_seed(4)
    own = reference_log_probs(model_dir, batch).values()
    batch["old_log_probs"] = jagged(own + 0.1 * torch.randn(own.shape, generator=generator), offsets)
    batch["advantages"] = jagged(torch.randn(own.shape, generator=generator), offsets)
    return batch


def in_process_update(model_dir, batch: TensorDict) -> dict[str, float]:
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=engine_config_from_dict({"backend": "fsdp"}),
        optimizer_config=OPTIMIZER,
    )
    engine.initialize()
    return Actor(engine, ACTOR_CONFIG).update_policy(batch)


@pytest.mark.slow
def test_two_ray_actors_match_references_and_fail_clearly(ray_cluster, model_dir) -> None:
    batch = rollout_batch(model_dir)
    spec = WorkerSpec(
        role="actor",
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=engine_config_from_dict({"backend": "fsdp"}),
        optimizer_config=OPTIMIZER,
        role_config=ACTOR_CONFIG,
    )
    with RayWorkerGroup(spec, world_size=2, num_cpus_per_worker=0.5, timeout_s=120) as group:
        assert [(w.dp_rank, w.dp_size, w.is_output_rank) for w in group.topology] == [
            (0, 2, True),
            (1, 2, True),
        ]
        log_probs = group.compute_log_prob(batch)["log_probs"]
        expected = reference_log_probs(model_dir, batch)
        torch.testing.assert_close(log_probs.values(), expected.values(), rtol=0, atol=1e-5)
        metrics = group.update_policy(batch)
        no_method = r"no_such_method failed on rank \d: AttributeError: rank \d: role Actor has no method"
        with pytest.raises(WorkerGroupError, match=no_method):
            group.execute_all("no_such_method")
        # A dead worker fails the call with its rank while its peer is still blocked in a collective.
        ray_cluster.kill(group.actors[1])
        with pytest.raises(WorkerGroupError, match=r"compute_log_prob failed on rank 1: The actor died"):
            group.compute_log_prob(batch)
    reference = in_process_update(model_dir, batch)
    for name in ("pg_loss", "grad_norm", "pg_clipfrac", "approx_kl"):
        assert metrics[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), name
    assert reference["grad_norm"] > 0
