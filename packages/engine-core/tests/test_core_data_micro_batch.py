"""Micro-batching: hard token cap, equal counts over simulated ranks, exact order restoration; DP sharding."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import (
    micro_batch_count,
    pad_micro_batch,
    partition_micro_batches,
    sequence_lengths,
    split_micro_batches,
)
from drivetrain_engine_core.backend import BatchError, MicroBatchCountRule
from drivetrain_engine_core.job import (
    MicroBatchConfig,
    jagged,
    make_batch,
    shard_data,
    shard_indices,
    unshard_data,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

BUDGET = 40


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 100, (n,), generator=gen) for n in lengths]
    return make_batch(
        ids, advantages=[torch.randn(n, generator=gen) for n in lengths], uid=torch.arange(len(lengths))
    )


def _fake_outputs(micro_batches):
    """What a backend returns: per-token values from each micro-batch's tokens, a per-sequence score."""
    return [
        TensorDict(
            log_probs=jagged(mb["input_ids"].values().double() / 7, mb["input_ids"].offsets()),
            score=mb["uid"] * 10,
            batch_size=mb.batch_size,
        )
        for mb in micro_batches.batches
    ]


def _check_restore(batch, micro_batches):
    restored = micro_batches.restore(_fake_outputs(micro_batches))
    assert torch.equal(restored["score"], batch["uid"] * 10)
    assert torch.equal(restored["log_probs"].values(), batch["input_ids"].values().double() / 7)
    # Rebuilt on the batch's own offsets: it multiplies with the batch's loss_mask.
    assert (restored["log_probs"] * batch["loss_mask"]).shape[0] == batch.batch_size[0]


rank_lengths = st.lists(st.lists(st.integers(1, BUDGET), min_size=6, max_size=24), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(ranks=rank_lengths)
def test_dynamic_micro_batches_respect_cap_agree_on_count_and_restore(ranks):
    # Simulated all-reduce: every rank contributes micro_batch_count and all use the maximum.
    counts = [micro_batch_count(torch.tensor(lens), BUDGET) for lens in ranks]
    for lens, own in zip(ranks, counts, strict=True):
        lower = -(-sum(lens) // BUDGET)
        assert lower <= own <= len(lens)
    agreed = max(counts)
    for lens in ranks:
        if len(lens) < agreed:
            with pytest.raises(
                BatchError, match=rf"{len(lens)} sequences cannot fill {agreed} micro-batches"
            ):
                partition_micro_batches(torch.tensor(lens), BUDGET, agreed)
            continue
        groups = partition_micro_batches(torch.tensor(lens), BUDGET, agreed)
        assert len(groups) == agreed and all(groups)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        assert max(sum(lens[i] for i in g) for g in groups) <= BUDGET


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, BUDGET), min_size=1, max_size=20), seed=st.integers(0, 9))
def test_split_dynamic_restores_original_order(lengths, seed):
    batch = _batch(lengths, seed)
    mbs = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=BUDGET))
    assert len(mbs.batches) == micro_batch_count(torch.tensor(lengths), BUDGET)
    for mb, idx in zip(mbs.batches, mbs.indices, strict=True):
        assert int(sequence_lengths(mb).sum()) <= BUDGET
        assert torch.equal(mb["uid"], idx)
    _check_restore(batch, mbs)


@pytest.mark.parametrize(("n", "size", "sizes"), [(7, 3, [3, 3, 1]), (6, 2, [2, 2, 2]), (2, 5, [2])])
def test_split_fixed_sizes_and_restore(n, size, sizes):
    batch = _batch([3 + i for i in range(n)])
    mbs = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=size))
    assert [mb.batch_size[0] for mb in mbs.batches] == sizes
    assert torch.cat(mbs.indices).tolist() == list(range(n))  # consecutive chunks
    _check_restore(batch, mbs)


def test_over_budget_sequence_names_index_length_budget():
    batch = _batch([5, 9, 60, 3])
    with pytest.raises(BatchError, match=r"sequence 2 has 60 tokens, more than .* max_tokens=40"):
        split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=BUDGET))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=14), seed=st.integers(0, 9))
def test_a_padded_budget_caps_rows_times_the_longest_sequence(lengths, seed):
    """``budget="padded"``: what the padded layout computes on (its ``input_ids`` of rows x longest) stays
    within max_tokens, every sequence lands in one micro-batch and the outputs come back in order."""
    batch = _batch(lengths, seed)
    config = MicroBatchConfig(micro_batch_size=None, max_tokens=24, budget="padded")
    split = split_micro_batches(batch, config)
    assert split.fillers == 0
    for micro_batch in split.batches:
        assert pad_micro_batch(micro_batch).input_ids.numel() <= 24
    assert sorted(torch.cat(split.indices).tolist()) == list(range(len(lengths)))
    _check_restore(batch, split)


def test_a_padded_budget_separates_what_the_token_budget_packs_together():
    """Eight sequences, one long: 15 real tokens fit one micro-batch of 16 tokens, but padded to the longest
    they are 8 x 8 = 64; the padded budget puts the long one with one short one (2 x 8) and the rest apart."""
    batch = _batch([8, 1, 1, 1, 1, 1, 1, 1])
    tokens = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=16))
    padded = split_micro_batches(
        batch, MicroBatchConfig(micro_batch_size=None, max_tokens=16, budget="padded")
    )
    assert [len(i) for i in tokens.indices] == [8]
    assert sorted(sequence_lengths(mb).tolist() for mb in padded.batches) == [[1, 1, 1, 1, 1, 1], [8, 1]]
    # A schedule that needs 4 micro-batches (another rank's count, or a pipeline multiple) splits the parts:
    # a subset never costs more padded length than its part; 8 sequences fill 4 without fillers.
    four = split_micro_batches(
        batch,
        MicroBatchConfig(micro_batch_size=None, max_tokens=16, budget="padded"),
        rule=MicroBatchCountRule(multiple_of=4),
    )
    assert (len(four.batches), four.fillers) == (4, 0)
    assert all(pad_micro_batch(mb).input_ids.numel() <= 16 for mb in four.batches)
    with pytest.raises(
        BatchError, match=r"sequence 0 has 8 tokens, more than the micro-batch limit max_tokens=6"
    ):
        split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=6, budget="padded"))
    with pytest.raises(ValueError, match=r"micro_batch.budget='rows' is not supported; choose one of"):
        MicroBatchConfig(micro_batch_size=None, max_tokens=6, budget="rows")  # type: ignore[arg-type]


def test_restore_rejects_mismatched_outputs():
    batch = _batch([4, 5, 6])
    mbs = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=2))
    outputs = _fake_outputs(mbs)
    with pytest.raises(BatchError, match=r"got 1 outputs for 2 micro-batches"):
        mbs.restore(outputs[:1])
    with pytest.raises(BatchError, match=r"output 1 has batch_size \[2\], its micro-batch has 1"):
        mbs.restore([outputs[0], outputs[0]])


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=8).map(lambda x: x * 4), balance=st.booleans()
)
def test_shard_unshard_round_trip(lengths, balance):
    batch = _batch(lengths)
    dp = 4
    indices = shard_indices(batch, dp, balance=balance)
    shards = [shard_data(batch, r, dp, balance=balance) for r in range(dp)]
    assert {s.batch_size[0] for s in shards} == {len(lengths) // dp}
    assert sorted(torch.cat(indices).tolist()) == list(range(len(lengths)))
    for shard, idx in zip(shards, indices, strict=True):
        assert torch.equal(shard["uid"], idx)
    results = [TensorDict(score=s["uid"] * 3, batch_size=s.batch_size) for s in shards]
    assert torch.equal(unshard_data(results, indices)["score"], batch["uid"] * 3)


def test_shard_errors():
    batch = _batch([3, 4, 5])
    with pytest.raises(BatchError, match=r"3 sequences cannot be split evenly over dp_size=2"):
        shard_data(batch, 0, 2)
    with pytest.raises(BatchError, match=r"dp_rank=3 is outside"):
        shard_data(batch, 3, 3)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, BUDGET), min_size=1, max_size=30), extra=st.integers(0, 3))
def test_bin_packing_fallback_fills_every_micro_batch_within_cap(lengths, extra):
    # The fallback used when no balanced partition fits: first-fit decreasing at any count from its own up.
    from drivetrain_engine_core._data.micro_batch import _first_fit_decreasing_count, _packed

    count = min(len(lengths), _first_fit_decreasing_count(lengths, BUDGET) + extra)
    assert count >= -(-sum(lengths) // BUDGET)
    groups = _packed(torch.tensor(lengths), BUDGET, count)
    assert len(groups) == count and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert max(sum(lengths[i] for i in g) for g in groups) <= BUDGET
