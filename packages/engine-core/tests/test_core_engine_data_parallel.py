"""Data parallelism through the base ``Engine`` on two gloo ranks: global token counts and loss scaling make
loss, gradient norm and updated weights equal those of one process training on the whole batch (also when one
rank is short of sequences and runs filler passes); a checkpoint
that fails verification on rank 0, or a malformed batch on rank 1 only, fails every rank at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from drivetrain_engine_core._data.rows import select_rows
from drivetrain_engine_core.backend import BatchError, CheckpointError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import MicroBatchConfig
from drivetrain_engine_core.kit import distributed
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.launcher import run_distributed
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine

VOCAB = 64
# Uneven prompt/response lengths give the two ranks different token counts, so a per-rank normalisation
# would show up as a different loss.
PROMPTS, RESPONSES = [2, 5, 1, 3], [6, 1, 4, 2]


def make_engine(micro_batch_size: int) -> TinyTorchEngine:
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(
            vocab_size=VOCAB, micro_batch=MicroBatchConfig(micro_batch_size=micro_batch_size)
        ),
        optimizer_config=OptimizerConfig(lr=0.1, clip_grad=None),
    )
    engine.initialize()
    return engine


def train_once(rank_indices: list[int] | None, micro_batch_size: int) -> dict[str, object]:
    engine = make_engine(micro_batch_size)
    batch = random_batch(vocab_size=VOCAB, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3)
    if rank_indices is not None:
        batch = select_rows(batch, torch.tensor(rank_indices))
    with engine.train_mode():
        output = engine.train_batch(batch, token_mean_nll)
    return {
        "loss": output.loss,
        "grad_norm": output.metrics["grad_norm"],
        "weights": dict(engine.export_weights()),
    }


def test_a_batch_that_needs_no_filler_builds_none(monkeypatch) -> None:
    """The filler (a one-row slice of the first micro-batch) was built on every call, filler or not."""
    from drivetrain_engine_core._data.micro_batch import MicroBatches

    def no_filler_wanted(self):
        raise AssertionError(f"a filler was built for a split with {self.fillers} filler passes")

    monkeypatch.setattr(MicroBatches, "filler", no_filler_wanted)
    assert train_once(None, micro_batch_size=2)["loss"] > 0


def load_corrupt_checkpoint(rank: int, root: Path) -> str:
    """Save on every rank, corrupt a file on rank 0, load: every rank must get the error, none may wait."""
    engine = make_engine(micro_batch_size=1)
    step = engine.save_checkpoint(root, global_step=1)
    if rank == 0:
        (step / "model" / "model.pt").write_bytes(b"not a checkpoint")
    distributed.barrier()
    try:
        engine.load_checkpoint(root)
    except CheckpointError as e:
        return str(e)
    return "loaded a corrupt checkpoint"


def train_with_bad_batch_on_rank_one(rank: int) -> str:
    """Rank 1's batch lacks ``loss_mask``: every rank must raise the same error, none may wait for it."""
    engine = make_engine(micro_batch_size=1)
    batch = random_batch(vocab_size=VOCAB, prompt_lengths=PROMPTS, response_lengths=RESPONSES, seed=3)
    if rank == 1:
        del batch["loss_mask"]
    try:
        with engine.train_mode():
            engine.train_batch(batch, token_mean_nll)
    except BatchError as e:
        return str(e)
    return "trained on a bad batch"


def _rank_main(rank: int, world_size: int, root: Path) -> dict[str, object]:
    mine = list(range(rank, len(PROMPTS), world_size))
    return {
        "trained": [
            train_once(mine, micro_batch_size=1),
            train_once(mine, micro_batch_size=2),
            # A short rank: rank 0 holds one sequence for the agreed 3 micro-batches, so it runs 2 filler passes;
            # they must add nothing to the loss, the gradient or the update (the reference runs no filler).
            train_once([0] if rank == 0 else [1, 2, 3], micro_batch_size=1),
        ],
        "corrupt": load_corrupt_checkpoint(rank, root),
        "bad_batch": train_with_bad_batch_on_rank_one(rank),
    }


@pytest.mark.slow
def test_two_ranks_match_one_process_and_fail_together_on_a_corrupt_checkpoint(tmp_path: Path) -> None:
    expected = train_once(None, micro_batch_size=4)
    per_rank = run_distributed(_rank_main, tmp_path, world_size=2, timeout_s=180)
    assert per_rank[0]["bad_batch"] == per_rank[1]["bad_batch"]
    assert per_rank[0]["bad_batch"].startswith("rank 1 (of failing ranks 1): ")
    assert "loss_mask" in per_rank[0]["bad_batch"]
    for results in per_rank:
        assert re.search(r"model\.pt has \d+ bytes, the manifest says", results["corrupt"]), results[
            "corrupt"
        ]
        for result in results["trained"]:
            assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
            assert result["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
            for name, tensor in expected["weights"].items():
                torch.testing.assert_close(result["weights"][name], tensor, rtol=1e-6, atol=1e-7)
