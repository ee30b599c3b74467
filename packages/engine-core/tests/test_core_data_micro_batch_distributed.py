"""Two gloo ranks with different data agree on the micro-batch count through the real all-reduce."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import (
    global_token_count,
    micro_batch_count,
    sequence_lengths,
    split_micro_batches,
)
from drivetrain_engine_core.backend import MicroBatchCountRule
from drivetrain_engine_core.job import MicroBatchConfig, make_batch, shard_data
from drivetrain_engine_core.testing.launcher import run_distributed

BUDGET = 32
# Rank 0 needs 2 micro-batches on its own, rank 1 needs 4; both must run 4.
RANK_LENGTHS = ([10, 12, 9, 11, 4], [30, 29, 31, 20, 5, 6])


def _rank_main(rank: int, world_size: int) -> dict:
    lengths = RANK_LENGTHS[rank]
    batch = make_batch([torch.arange(n) for n in lengths], loss_mask=[torch.arange(n) % 2 for n in lengths])
    dynamic = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=None, max_tokens=BUDGET))
    fixed = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=5 if rank == 0 else 2))
    # Interleaved-pipeline rule: rank 1's 3 fixed micro-batches become 4 on both ranks.
    ruled = split_micro_batches(
        batch, MicroBatchConfig(micro_batch_size=2), rule=MicroBatchCountRule(minimum=2, multiple_of=2)
    )
    # Only rank 0 is short of sequences (2 for 4 micro-batches): it runs each alone, then 2 filler passes.
    too_few = split_micro_batches(
        batch[:2] if rank == 0 else batch, MicroBatchConfig(micro_batch_size=None, max_tokens=BUDGET)
    )
    return {
        "own_count": micro_batch_count(torch.tensor(lengths), BUDGET),
        "dynamic_tokens": [int(sequence_lengths(mb).sum()) for mb in dynamic.batches],
        "dynamic_order": sorted(torch.cat(dynamic.indices).tolist()),
        "fixed_sizes": [mb.batch_size[0] for mb in fixed.batches],
        "ruled_sizes": [mb.batch_size[0] for mb in ruled.batches],
        "global_tokens": global_token_count(batch),
        "too_few": ([len(i) for i in too_few.indices], too_few.fillers, too_few.count),
    }


@pytest.mark.slow
def test_ranks_agree_on_counts_over_gloo():
    per_rank = run_distributed(_rank_main, world_size=2, timeout_s=180)
    assert [r["own_count"] for r in per_rank] == [2, 4]
    for rank, result in enumerate(per_rank):
        assert len(result["dynamic_tokens"]) == 4 and max(result["dynamic_tokens"]) <= BUDGET
        assert result["dynamic_order"] == list(range(len(RANK_LENGTHS[rank])))
    # Fixed: rank 0 alone would run 1 micro-batch of 5, rank 1 runs 3 of 2; rank 0 splits into 3 near-equal.
    assert per_rank[0]["fixed_sizes"] == [2, 2, 1] and per_rank[1]["fixed_sizes"] == [2, 2, 2]
    expected_tokens = sum(sum(n // 2 for n in lens) for lens in RANK_LENGTHS)
    assert [r["global_tokens"] for r in per_rank] == [expected_tokens] * 2
    assert per_rank[0]["ruled_sizes"] == [2, 1, 1, 1] and per_rank[1]["ruled_sizes"] == [2, 2, 1, 1]
    assert per_rank[0]["too_few"] == ([1, 1], 2, 4)
    assert per_rank[1]["too_few"][1:] == (0, 4)


def test_shard_then_micro_batch_keeps_every_sequence():
    lengths = [5, 30, 7, 22, 3, 18, 9, 25]
    batch = make_batch([torch.arange(n) for n in lengths], uid=torch.arange(8))
    seen = []
    for rank in range(2):
        shard = shard_data(batch, rank, 2)
        mbs = split_micro_batches(shard, MicroBatchConfig(micro_batch_size=None, max_tokens=BUDGET))
        seen += torch.cat([mb["uid"] for mb in mbs.batches]).tolist()
    assert sorted(seen) == list(range(8))
