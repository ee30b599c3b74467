"""Dispatching a global batch over data-parallel ranks and gathering the results back.

Every rank computes the same deterministic assignment from the same global batch, so no communication is
needed to agree on it. Balanced sharding gives every rank the same number of sequences (so micro-batch counts
and per-rank loss weights stay comparable) and near-equal workload.

Sequences sharing a ``uid`` (:mod:`.groups`) go to one rank together: sharding then deals groups, and every
rank gets the same number of groups. The rule for a batch whose sequence (group) count is not a multiple of
the data-parallel size: an error naming the fix, unless the caller asks for ``uneven`` shards, which are then
balanced by workload with at least one sequence (group) per rank. Uneven shards train exactly like even ones
because losses normalise by counts over every rank (``LossContext``), never by a rank's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from .._errors import BatchError
from .batch import sequence_lengths
from .groups import expand_groups, group_totals, sequence_groups
from .micro_batch import MicroBatches
from .partition import estimate_workload, karmarkar_karp
from .rows import select_rows


def shard_indices(
    batch: TensorDict, dp_size: int, balance: bool = True, *, uneven: bool = False
) -> list[Tensor]:
    """Original sequence indices of each rank's shard (sorted ascending within a shard).

    Args:
        batch: the global batch; sequences sharing a ``uid`` stay on one rank.
        dp_size: number of data-parallel ranks.
        balance: Karmarkar-Karp on workload (equal counts); else contiguous chunks.
        uneven: allow a sequence (group) count that is not a multiple of ``dp_size``: shards of unequal
            counts, balanced by workload.

    Raises:
        BatchError: fewer sequences (groups) than ranks, or a count not divisible by ``dp_size`` without
            ``uneven``.
    """
    groups = sequence_groups(batch)
    lengths = sequence_lengths(batch)
    workloads = estimate_workload(lengths)
    if groups is not None:
        workloads = group_totals(workloads, groups)
    units, unit = len(workloads), "sequences" if groups is None else "groups (sequences sharing a uid)"
    if dp_size < 1 or units < dp_size or (units % dp_size and not uneven):
        raise BatchError(
            f"shard_data: {units} {unit} cannot be split evenly over dp_size={dp_size} ranks; make the global "
            "batch size a multiple of the data-parallel size"
            + (
                ", or pass uneven=True for workload-balanced shards of unequal sizes."
                if units >= dp_size
                else "."
            )
        )
    if not balance:
        parts = [p.tolist() for p in torch.arange(units).tensor_split(dp_size)]
    else:
        parts = karmarkar_karp(workloads.tolist(), dp_size, equal_size=units % dp_size == 0)
    return expand_groups(parts, groups)


def shard_data(
    batch: TensorDict, dp_rank: int, dp_size: int, *, balance: bool = True, uneven: bool = False
) -> TensorDict:
    """The shard of ``batch`` that data-parallel rank ``dp_rank`` processes (see :func:`shard_indices`).

    Raises:
        BatchError: ``dp_rank`` is out of range or the batch does not split as asked.
    """
    if not 0 <= dp_rank < dp_size:
        raise BatchError(f"shard_data: dp_rank={dp_rank} is outside [0, {dp_size}).")
    index = shard_indices(batch, dp_size, balance, uneven=uneven)[dp_rank]
    return select_rows(batch, index)


def unshard_data(shards: Sequence[TensorDict], indices: Sequence[Tensor]) -> TensorDict:
    """Gather per-rank results back into the global batch's original order.

    Args:
        shards: one result TensorDict per rank, rows in that rank's shard order.
        indices: :func:`shard_indices` of the global batch.
    """
    return MicroBatches(batches=list(shards), indices=list(indices)).restore(shards)
