"""The roles' losses through a real engine: loss and gradient norm equal a plain Hugging Face reference,
whatever the micro-batching (fixed sizes, dynamic token budget) or the data-parallel size (2 ranks).

The PPO case uses rollout log-probs near the model's own (so some tokens clip and some do not), an entropy
bonus and a k3 KL penalty with seq-mean-token-mean aggregation.
"""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core.backend import ForwardOptions, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import create_engine, engine_config_from_dict, jagged
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_log_probs,
    reference_loss_and_grad_norm,
    run_distributed,
)
from drivetrain_roles.losses import PolicyLossConfig, policy_loss_fn, sft_loss_fn

VOCAB = 100
PPO = PolicyLossConfig(
    clip_ratio_low=0.05,
    clip_ratio_high=0.05,
    entropy_coeff=0.01,
    kl_loss_coef=0.1,
    kl_estimator="k3",
    loss_agg_mode="seq-mean-token-mean",
)
LOSSES = {
    "token-mean": sft_loss_fn("token-mean"),
    "seq-mean-token-sum": sft_loss_fn("seq-mean-token-sum"),
    "seq-mean-token-mean": sft_loss_fn("seq-mean-token-mean"),
    "ppo": policy_loss_fn(PPO),
}
MICRO_BATCHES = {
    "one_per_micro_batch": {"micro_batch_size": 1},
    "three_per_micro_batch": {"micro_batch_size": 3},
    "dynamic_14_tokens": {"micro_batch_size": None, "max_tokens": 14},
}


def rollout_batch(model_dir):
    """Random sequences with PPO fields: old log-probs = the model's own + noise, random advantages."""
    batch = random_batch(
        vocab_size=VOCAB, prompt_lengths=[3, 5, 2, 4, 6, 1], response_lengths=[5, 2, 7, 3, 5, 6], seed=3
    )
    offsets = batch["input_ids"].offsets()
    generator = torch.Generator().manual_seed(4)
    own = reference_log_probs(model_dir, batch).values()
    noise = lambda: 0.1 * torch.randn(own.shape, generator=generator)  # noqa: E731
    batch["old_log_probs"] = jagged(own + noise(), offsets)
    batch["ref_log_prob"] = jagged(own + noise(), offsets)
    batch["advantages"] = jagged(torch.randn(own.shape, generator=generator), offsets)
    return batch


def losses_and_grad_norms(model_dir, micro_batch, batch) -> dict[str, tuple[float, float]]:
    """``(loss, grad_norm)`` per loss from ``train_batch`` with lr=0, so the weights never change."""
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=engine_config_from_dict({"backend": "fsdp", "micro_batch": micro_batch}),
        optimizer_config=OptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=None),
    )
    engine.initialize()
    results = {}
    with engine.train_mode():
        for name, loss_fn in LOSSES.items():
            output = engine.train_batch(batch, loss_fn, options=ForwardOptions(compute_entropy=True))
            results[name] = (output.loss, output.metrics["grad_norm"])
    return results


def two_rank_worker(rank, world_size, model_dir, batch):
    shard = batch[rank::world_size]
    return {name: losses_and_grad_norms(model_dir, mb, shard) for name, mb in MICRO_BATCHES.items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("inv"), arch="llama", vocab_size=VOCAB, with_tokenizer=False
    )


@pytest.fixture(scope="module")
def batch(model_dir):
    return rollout_batch(model_dir)


@pytest.fixture(scope="module")
def references(model_dir, batch):
    with_entropy = ForwardOptions(compute_entropy=True)
    return {
        name: reference_loss_and_grad_norm(model_dir, batch, fn, options=with_entropy)
        for name, fn in LOSSES.items()
    }


def assert_matches(results, references) -> None:
    assert set(results) == set(references)
    for name, (loss, norm) in results.items():
        ref_loss, ref_norm = references[name]
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), name
        assert norm == pytest.approx(ref_norm, rel=1e-4, abs=1e-6), name


def test_loss_and_gradient_with_dynamic_micro_batches_on_one_rank(model_dir, batch, references) -> None:
    assert_matches(losses_and_grad_norms(model_dir, MICRO_BATCHES["dynamic_14_tokens"], batch), references)


@pytest.mark.slow
def test_loss_and_gradient_do_not_depend_on_micro_batching_on_two_ranks(model_dir, batch, references) -> None:
    per_rank = run_distributed(two_rank_worker, str(model_dir), batch, world_size=2, timeout_s=300)
    for results in per_rank:
        for micro_batch in MICRO_BATCHES:
            assert_matches(results[micro_batch], references)
