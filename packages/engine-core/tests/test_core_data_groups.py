"""Group-aware batching: sequences sharing a ``uid`` stay in one micro-batch and on one data-parallel rank,
per-sequence non-tensor fields travel through the engine and come back in order, and the uneven-shard rule
trains exactly like one process (two gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import sequence_lengths, split_micro_batches
from drivetrain_engine_core._data.options import refuse_batch_options
from drivetrain_engine_core.backend import BatchError, ModelConfig, OptimizerConfig
from drivetrain_engine_core.job import (
    MicroBatchConfig,
    make_batch,
    sequence_groups,
    shard_data,
    shard_indices,
    unshard_data,
)
from drivetrain_engine_core.testing.batches import random_batch
from drivetrain_engine_core.testing.launcher import run_distributed
from drivetrain_engine_core.testing.losses import token_mean_nll
from drivetrain_engine_core.testing.tiny_engine import TinyEngineConfig, TinyTorchEngine
from tensordict import TensorDict

VOCAB = 64
# Six pairs of uneven lengths: chosen/rejected of one prompt share a uid.
LENGTHS = [5, 7, 12, 3, 9, 9, 4, 11, 6, 6, 14, 2]
UIDS = [f"p{i // 2}" for i in range(len(LENGTHS))]


def grouped_batch(lengths=LENGTHS, uids=UIDS) -> TensorDict:
    batch = make_batch([torch.arange(n) % VOCAB for n in lengths])
    batch["uid"] = list(uids)
    batch["data_source"] = [f"source-{i}" for i in range(len(lengths))]
    return batch


def assert_groups_whole(parts: list[torch.Tensor], uids: list[str]) -> None:
    owner = {}
    for number, part in enumerate(parts):
        for i in part.tolist():
            assert owner.setdefault(uids[i], number) == number, f"{uids[i]} split over parts"


@pytest.mark.parametrize(
    "config",
    [
        MicroBatchConfig(micro_batch_size=None, max_tokens=24),
        MicroBatchConfig(micro_batch_size=None, max_tokens=30),
        MicroBatchConfig(micro_batch_size=2),
        MicroBatchConfig(micro_batch_size=5),
    ],
    ids=["dynamic-24", "dynamic-30", "fixed-2", "fixed-5"],
)
def test_micro_batches_keep_groups_whole_within_the_limit_and_restore_in_order(config) -> None:
    batch = grouped_batch()
    micro = split_micro_batches(batch, config)
    assert_groups_whole(micro.indices, UIDS)
    assert sorted(torch.cat(micro.indices).tolist()) == list(range(len(LENGTHS)))
    for mb, idx in zip(micro.batches, micro.indices, strict=True):
        if config.max_tokens is not None:
            assert int(sequence_lengths(mb).sum()) <= config.max_tokens
        else:
            assert len(idx) <= config.micro_batch_size
        assert mb.get("uid").tolist() == [UIDS[i] for i in idx.tolist()]
    outputs = [
        TensorDict(score=sequence_lengths(mb).float(), batch_size=mb.batch_size) for mb in micro.batches
    ]
    restored = micro.restore(outputs)
    assert restored["score"].tolist() == [float(n) for n in LENGTHS]
    assert restored.get("uid").tolist() == UIDS
    assert restored.get("data_source").tolist() == [f"source-{i}" for i in range(len(LENGTHS))]


def test_a_group_over_the_limit_is_one_error_naming_the_group_and_the_fix() -> None:
    batch = grouped_batch()
    with pytest.raises(
        BatchError,
        match=r"the group of uid 'p2' \(sequences \[4, 5\]\) has 18 tokens, more than the micro-batch limit "
        r"max_tokens=15 \(sequences sharing a uid stay in one micro-batch\); raise micro_batch.max_tokens to "
        r"at least 18 or truncate",
    ):
        split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=15))
    with pytest.raises(BatchError, match=r"has 2 sequences, more than .* micro_batch_size=1"):
        split_micro_batches(batch, MicroBatchConfig(micro_batch_size=1))


def test_per_sequence_fields_are_not_options_but_batch_metadata_still_fails() -> None:
    batch = grouped_batch()
    refuse_batch_options(batch)  # uid is a per-sequence field, not an option
    batch.set_non_tensor("temprature", 0.5)
    with pytest.raises(
        BatchError, match=r"batch entry 'temprature' is not a tensor.*Did you mean 'temperature'"
    ):
        refuse_batch_options(batch)


def test_groups_need_not_be_adjacent_and_distinct_uids_are_no_groups() -> None:
    assert sequence_groups(grouped_batch(uids=["a", "b", "a", "c"], lengths=[1, 2, 3, 4])) == [
        [0, 2],
        [1],
        [3],
    ]
    assert sequence_groups(grouped_batch(uids=["a", "b"], lengths=[1, 2])) is None
    assert sequence_groups(make_batch([torch.arange(3)])) is None


def test_sharding_keeps_groups_on_one_rank_balanced_and_gathers_back_in_order() -> None:
    batch = grouped_batch()
    for dp_size in (2, 3, 6):
        indices = shard_indices(batch, dp_size)
        assert_groups_whole(indices, UIDS)
        assert {len(i) for i in indices} == {len(LENGTHS) // dp_size}
        tokens = [sum(LENGTHS[i] for i in idx.tolist()) for idx in indices]
        assert max(tokens) - min(tokens) <= max(LENGTHS)
        shards = [shard_data(batch, r, dp_size) for r in range(dp_size)]
        gathered = unshard_data(shards, indices)
        assert gathered.get("uid").tolist() == UIDS
        assert torch.equal(gathered["input_ids"].values(), batch["input_ids"].values())


def test_uneven_rule_errors_with_the_fix_or_balances_uneven_shards() -> None:
    batch = grouped_batch()
    with pytest.raises(
        BatchError,
        match=r"6 groups \(sequences sharing a uid\) cannot be split evenly over "
        r"dp_size=4 ranks; .* or pass uneven=True",
    ):
        shard_indices(batch, 4)
    indices = shard_indices(batch, 4, uneven=True)
    assert_groups_whole(indices, UIDS)
    assert all(len(i) >= 2 for i in indices)
    assert sorted(torch.cat(indices).tolist()) == list(range(len(LENGTHS)))
    with pytest.raises(BatchError, match=r"6 groups .* over dp_size=7 ranks; make the global batch size"):
        shard_indices(batch, 7, uneven=True)


def tiny_engine(config: MicroBatchConfig) -> TinyTorchEngine:
    engine = TinyTorchEngine(
        model_config=ModelConfig(path="tiny-model"),
        engine_config=TinyEngineConfig(vocab_size=VOCAB, micro_batch=config),
        optimizer_config=OptimizerConfig(lr=0.1, clip_grad=None),
    )
    engine.initialize()
    return engine


def preference_batch() -> TensorDict:
    """Three pairs (six sequences) of random tokens, chosen and rejected of a prompt sharing a uid."""
    batch = random_batch(
        vocab_size=VOCAB, prompt_lengths=[3, 3, 5, 5, 2, 2], response_lengths=[4, 6, 2, 7, 5, 1], seed=7
    )
    batch["uid"] = ["a", "a", "b", "b", "c", "c"]
    return batch


def train(batch: TensorDict, config: MicroBatchConfig) -> dict[str, object]:
    engine = tiny_engine(config)
    seen: list[list[str]] = []

    def loss_fn(output, micro_batch, context):
        seen.append(micro_batch.get("uid").tolist())
        return token_mean_nll(output, micro_batch, context)

    with engine.train_mode():
        result = engine.train_batch(batch, loss_fn)
    return {
        "loss": result.loss,
        "grad_norm": result.metrics["grad_norm"],
        "uids": result.outputs.get("uid").tolist(),
        "seen": seen,
    }


def test_engine_micro_batches_hold_whole_groups_and_outputs_carry_uids_in_order() -> None:
    batch = preference_batch()
    result = train(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=20))
    assert result["uids"] == batch.get("uid").tolist()
    assert len(result["seen"]) > 1
    for uids in result["seen"]:
        assert len(uids) % 2 == 0 and all(uids.count(u) == 2 for u in uids)


def _rank_main(rank: int, world_size: int) -> dict[str, object]:
    batch = preference_batch()
    shard = shard_data(batch, rank, world_size, uneven=True)  # 3 pairs over 2 ranks: 1 and 2 pairs
    over_budget = None
    try:
        # Only rank 1's group (19 tokens) is over the 12-token budget; both ranks must raise.
        split_micro_batches(
            batch[4:6] if rank == 0 else batch[2:4], MicroBatchConfig(micro_batch_size=None, max_tokens=12)
        )
    except BatchError as e:
        over_budget = str(e)
    return {
        "shard_uids": shard.get("uid").tolist(),
        "trained": [
            # One micro-batch on each rank: the rank with one pair cannot fill more.
            train(shard, MicroBatchConfig(micro_batch_size=4)),
            train(shard, MicroBatchConfig(micro_batch_size=None, max_tokens=40)),
        ],
        "over_budget": over_budget,
    }


@pytest.mark.slow
def test_two_ranks_on_uneven_grouped_shards_train_like_one_process() -> None:
    expected = train(preference_batch(), MicroBatchConfig(micro_batch_size=6))
    per_rank = run_distributed(_rank_main, world_size=2, timeout_s=180)
    assert sorted(len(r["shard_uids"]) for r in per_rank) == [2, 4]
    assert per_rank[0]["over_budget"] == per_rank[1]["over_budget"]
    assert per_rank[0]["over_budget"].startswith(
        "rank 1 (of failing ranks 1): micro-batching: the group of uid"
    )
    for result in per_rank:
        for trained in result["trained"]:
            assert trained["loss"] == pytest.approx(expected["loss"], rel=1e-6)
            assert trained["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)
            assert trained["uids"] == result["shard_uids"]
