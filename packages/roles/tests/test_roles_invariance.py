"""The roles' losses through a real engine: loss and gradient norm equal a plain Hugging Face reference,
whatever the micro-batching (fixed sizes, dynamic token budget) or the data-parallel size (2 ranks)."""

from __future__ import annotations

import pytest
from drivetrain_engine_core.config import ModelConfig, OptimizerConfig
from drivetrain_engine_core.factory import create_engine, engine_config_from_dict
from drivetrain_engine_core.testing import (
    make_tiny_model_dir,
    random_batch,
    reference_loss_and_grad_norm,
    run_distributed,
)
from drivetrain_roles.losses import sft_loss_fn

VOCAB = 100
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
MICRO_BATCHES = {
    "one_per_micro_batch": {"micro_batch_size": 1},
    "three_per_micro_batch": {"micro_batch_size": 3},
    "dynamic_14_tokens": {"micro_batch_size": None, "max_tokens": 14},
}


def global_batch():
    return random_batch(
        vocab_size=VOCAB, prompt_lengths=[3, 5, 2, 4, 6, 1], response_lengths=[5, 2, 7, 3, 5, 6], seed=3
    )


def losses_and_grad_norms(model_dir, micro_batch, batch) -> dict[str, tuple[float, float]]:
    """``(loss, grad_norm)`` per mode from ``train_batch`` with lr=0, so the weights never change."""
    engine = create_engine(
        model_config=ModelConfig(path=str(model_dir)),
        engine_config=engine_config_from_dict({"backend": "fsdp", "micro_batch": micro_batch}),
        optimizer_config=OptimizerConfig(lr=0.0, weight_decay=0.0, clip_grad=None),
    )
    engine.initialize()
    results = {}
    with engine.train_mode():
        for mode in MODES:
            output = engine.train_batch(batch, sft_loss_fn(mode))
            results[mode] = (output.loss, output.metrics["grad_norm"])
    return results


def two_rank_worker(rank, world_size, model_dir):
    shard = global_batch()[rank::world_size]
    return {name: losses_and_grad_norms(model_dir, mb, shard) for name, mb in MICRO_BATCHES.items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("inv"), arch="llama", vocab_size=VOCAB, with_tokenizer=False
    )


@pytest.fixture(scope="module")
def references(model_dir):
    return {
        mode: reference_loss_and_grad_norm(model_dir, global_batch(), sft_loss_fn(mode)) for mode in MODES
    }


def assert_matches(results, references) -> None:
    for mode, (loss, norm) in results.items():
        ref_loss, ref_norm = references[mode]
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), mode
        assert norm == pytest.approx(ref_norm, rel=1e-4, abs=1e-6), mode


def test_sft_loss_and_gradient_with_dynamic_micro_batches_on_one_rank(model_dir, references) -> None:
    assert_matches(
        losses_and_grad_norms(model_dir, MICRO_BATCHES["dynamic_14_tokens"], global_batch()), references
    )


@pytest.mark.slow
def test_sft_loss_and_gradient_do_not_depend_on_micro_batching_on_two_ranks(model_dir, references) -> None:
    per_rank = run_distributed(two_rank_worker, str(model_dir), world_size=2, timeout_s=300)
    for results in per_rank:
        for micro_batch in MICRO_BATCHES:
            assert_matches(results[micro_batch], references)
