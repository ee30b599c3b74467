"""Dispatching a global batch over data-parallel ranks and gathering the results back.

Every rank computes the same deterministic assignment from the same global batch, so no communication is
needed to agree on it. Balanced sharding gives every rank the same number of sequences (so micro-batch counts
and per-rank loss weights stay comparable) and near-equal workload.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from ..errors import BatchError
from .batch import sequence_lengths
from .micro_batch import MicroBatches
from .partition import estimate_workload, karmarkar_karp
from .rows import select_rows


def shard_indices(batch: TensorDict, dp_size: int, balance: bool = True) -> list[Tensor]:
    """Original sequence indices of each rank's shard (sorted ascending within a shard).

    Args:
        batch: the global batch; its size must be divisible by ``dp_size``.
        dp_size: number of data-parallel ranks.
        balance: equal-count Karmarkar-Karp on workload; else contiguous chunks.

    Raises:
        BatchError: the batch size is not divisible by ``dp_size``.
    """
    n = batch.batch_size[0]
    if dp_size < 1 or n % dp_size:
        raise BatchError(
            f"shard_data: {n} sequences cannot be split evenly over dp_size={dp_size} ranks; make the global "
            "batch size a multiple of the data-parallel size."
        )
    if not balance:
        return list(torch.arange(n).chunk(dp_size))
    groups = karmarkar_karp(estimate_workload(sequence_lengths(batch)).tolist(), dp_size, equal_size=True)
    return [torch.tensor(g, dtype=torch.int64) for g in groups]


def shard_data(batch: TensorDict, dp_rank: int, dp_size: int, *, balance: bool = True) -> TensorDict:
    """The shard of ``batch`` that data-parallel rank ``dp_rank`` processes.

    Raises:
        BatchError: ``dp_rank`` is out of range or the batch does not split evenly.
    """
    if not 0 <= dp_rank < dp_size:
        raise BatchError(f"shard_data: dp_rank={dp_rank} is outside [0, {dp_size}).")
    index = shard_indices(batch, dp_size, balance)[dp_rank]
    return select_rows(batch, index)


def unshard_data(shards: Sequence[TensorDict], indices: Sequence[Tensor]) -> TensorDict:
    """Gather per-rank results back into the global batch's original order.

    Args:
        shards: one result TensorDict per rank, rows in that rank's shard order.
        indices: :func:`shard_indices` of the global batch.
    """
    return MicroBatches(batches=list(shards), indices=list(indices)).restore(shards)
