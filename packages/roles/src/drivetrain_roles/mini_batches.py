"""Cutting a rank's share of a rollout batch into PPO mini-batches, the same count on every rank.

The number of mini-batches comes from the *global* sequence count (all-reduced over data-parallel ranks),
so every rank runs the same number of optimizer steps even when core's balanced sharding gave the ranks
different numbers of sequences; a rank with fewer sequences than mini-batches is an error on every rank,
never a hang.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from drivetrain_engine_core.backend import BatchError
from drivetrain_engine_core.job import ProcessGroup, agreed_checks
from drivetrain_engine_core.kit import distributed
from tensordict import TensorDict


@dataclass(kw_only=True, frozen=True)
class UpdateSchedule:
    """How one update call walks over its batch.

    Attributes:
        mini_batch_size: sequences per optimizer step over all data-parallel ranks together.
        epochs: passes over the batch.
        shuffle: draw a new order each epoch (seeded by ``seed``, the update count and the epoch).
        seed: base seed of the shuffling.
    """

    mini_batch_size: int = 4
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mini_batch_size <= 0:
            raise ValueError(f"mini_batch_size must be > 0, got {self.mini_batch_size}.")
        if self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}.")


def count_mini_batches(local_size: int, mini_batch_size: int, dp_group: ProcessGroup | None) -> int:
    """Mini-batches per epoch: global sequences / ``mini_batch_size``, rounded up, equal on every rank.

    Raises:
        BatchError: on every rank, when a rank holds fewer sequences than that (some mini-batch would be
            empty); it was raised on that rank alone while the others waited in the first step's collectives.
    """
    global_size = int(distributed.all_reduce_sum(local_size, dp_group))
    count = math.ceil(global_size / mini_batch_size)
    with agreed_checks(dp_group):
        if local_size < count:
            raise BatchError(
                f"this data-parallel rank holds {local_size} sequences but the update needs {count} mini-batches "
                f"({global_size} sequences / mini_batch_size={mini_batch_size}); raise mini_batch_size or send "
                "more sequences per rank."
            )
    return count


def iterate_mini_batches(
    batch: TensorDict, schedule: UpdateSchedule, dp_group: ProcessGroup | None, update_index: int = 0
) -> Iterator[TensorDict]:
    """Yield ``epochs * count`` mini-batches of ``batch`` (this rank's share), reshuffled each epoch."""
    count = count_mini_batches(len(batch), schedule.mini_batch_size, dp_group)
    for epoch in range(schedule.epochs):
        order = torch.arange(len(batch))
        if schedule.shuffle:
            generator = torch.Generator().manual_seed(schedule.seed + 1_000_003 * update_index + epoch)
            order = torch.randperm(len(batch), generator=generator)
        for indices in torch.tensor_split(order, count):
            yield batch[indices]
