"""An update's checks of its batch fail on every data-parallel rank: a rank that raised alone left the others
waiting in the first step's collectives until the process-group timeout (under Ray, for good).

Two gloo ranks stand in for two data-parallel ranks with uneven shares of a rollout.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from drivetrain_engine_core.testing.launcher import run_distributed


def _mini_batch_count(rank: int, world_size: int) -> str:
    from drivetrain_engine_core.backend import BatchError
    from drivetrain_roles.mini_batches import count_mini_batches

    try:
        return str(count_mini_batches((1, 5)[rank], 2, None))  # 6 sequences in 3 mini-batches; rank 0 has 1
    except BatchError as e:
        return str(e)


def _actor_update(rank: int, world_size: int) -> str:
    from drivetrain_engine_core.backend import BatchError
    from drivetrain_engine_core.job import make_batch
    from drivetrain_roles.actor import Actor

    ids = [torch.tensor([1, 2, 3])]
    fields = {"loss_mask": [torch.tensor([False, True, True])], "old_log_probs": [torch.zeros(3)]}
    if rank == 1:
        fields["advantages"] = [torch.zeros(3)]  # rank 0's share lacks the advantages
    actor = Actor(SimpleNamespace(data_parallel_group=None))  # type: ignore[arg-type]
    try:
        actor.update_policy(make_batch(ids, **fields))
    except BatchError as e:
        return str(e)
    return "updated"


def test_a_rank_with_too_few_sequences_for_the_mini_batches_fails_every_rank() -> None:
    first, second = run_distributed(_mini_batch_count, world_size=2)
    assert first == second
    assert first.startswith("rank 0 (of failing ranks 0): this data-parallel rank holds 1 sequences but")


def test_a_share_missing_a_field_fails_every_rank() -> None:
    first, second = run_distributed(_actor_update, world_size=2)
    assert first == second and "missing field 'advantages'" in first
