"""Splitting a global batch over a worker group's data-parallel ranks and gathering the answers back.

Workers that share a data-parallel rank (tensor/pipeline peers) get the same shard; only output ranks
(one per data-parallel rank) hand results back. The plan is computed on the driver from core's balanced
``shard_indices``, so the gathered result is in the global batch's original order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import shard_indices, unshard_data
from tensordict import TensorDict
from torch import Tensor

from ..batch_inputs import RoleBatch


@dataclass(kw_only=True, frozen=True)
class WorkerTopology:
    """Where one worker sits in the data-parallel layout, as its engine reports it.

    Attributes:
        rank: the worker's global rank in the group.
        dp_rank: its engine's ``data_parallel_rank``.
        dp_size: its engine's ``data_parallel_size``.
        is_output_rank: whether its engine returns outputs for its data-parallel rank.
    """

    rank: int
    dp_rank: int
    dp_size: int
    is_output_rank: bool

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"worker {self.rank}: dp_rank={self.dp_rank} is outside [0, {self.dp_size}).")


def check_topology(workers: Sequence[WorkerTopology]) -> int:
    """Validate that the workers form one data-parallel layout; return its size.

    Raises:
        ValueError: the workers disagree on ``dp_size``, or some data-parallel rank has no output rank or more
            than one.
    """
    sizes = {worker.dp_size for worker in workers}
    if len(sizes) != 1:
        raise ValueError(
            f"workers disagree on data_parallel_size: {sorted(sizes)}; they must share one mesh."
        )
    dp_size = sizes.pop()
    outputs = [sum(w.is_output_rank for w in workers if w.dp_rank == r) for r in range(dp_size)]
    if any(count != 1 for count in outputs):
        raise ValueError(
            f"each data-parallel rank needs exactly one output rank; output ranks per dp rank: {outputs}."
        )
    return dp_size


@dataclass(kw_only=True, frozen=True)
class DispatchPlan:
    """Which rows of a global batch each worker receives, and how to put the answers back in order.

    A padded batch (the roles' other input form, see :mod:`..batch_inputs`) travels in no-padding form and
    per-token answers come back padded, as the roles themselves answer in-process.

    Attributes:
        indices: original row indices of each data-parallel rank's shard.
        workers: the group's topology, one entry per worker in rank order.
        batch: the global batch in no-padding form, and the caller's padding.
    """

    indices: list[Tensor]
    workers: list[WorkerTopology]
    batch: RoleBatch

    @classmethod
    def for_batch(
        cls,
        batch: TensorDict,
        workers: Sequence[WorkerTopology],
        *,
        balance: bool = True,
        uneven: bool = False,
    ) -> DispatchPlan:
        """Plan the dispatch of ``batch`` (no-padding or padded) over ``workers``; ``uneven`` allows a
        sequence (group) count that the data-parallel size does not divide (workload-balanced shards of unequal
        counts: a batch after filtering, as DAPO's dynamic sampling leaves it).

        Raises:
            BatchError: the batch does not split evenly over the data-parallel size (without ``uneven``), has
                fewer sequences than data-parallel ranks, or is padded without an ``attention_mask``.
        """
        dp_size = check_topology(workers)
        role_batch = RoleBatch.wrap(batch)
        indices = shard_indices(role_batch.nopad, dp_size, balance, uneven=uneven)
        return cls(indices=indices, workers=list(workers), batch=role_batch)

    def shards(self) -> list[TensorDict]:
        """Each worker's shard, in worker rank order (peers of one data-parallel rank get the same rows)."""
        batch = self.batch.nopad
        by_dp_rank = [
            batch[index if batch.device is None else index.to(batch.device)] for index in self.indices
        ]
        return [by_dp_rank[worker.dp_rank] for worker in self.workers]

    def gather(self, results: Sequence[Any]) -> Any:
        """Merge the per-worker results of one call.

        TensorDict results from the output ranks are put back into the global batch's order (and form: padded
        per-token outputs for a padded batch); anything else (e.g. update metrics, already reduced over
        data-parallel ranks) is taken from the first output rank.

        Args:
            results: one result per worker, in worker rank order.

        Raises:
            BatchError: an output rank returned no TensorDict while others did.
        """
        if len(results) != len(self.workers):
            raise BatchError(f"gather: expected {len(self.workers)} worker results, got {len(results)}.")
        by_dp_rank = {
            w.dp_rank: result for w, result in zip(self.workers, results, strict=True) if w.is_output_rank
        }
        ordered = [by_dp_rank[r] for r in range(len(self.indices))]
        kinds = {isinstance(result, TensorDict) for result in ordered}
        if kinds == {True}:
            return self.batch.restore(unshard_data(ordered, self.indices))
        if True in kinds:
            raise BatchError(
                "gather: some output ranks returned a TensorDict and others did not "
                f"({[type(r).__name__ for r in ordered]}); the role method must return the same kind on every rank."
            )
        return ordered[0]
