"""The test launcher: results in rank order, a failing rank's traceback, a hanging rank's timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from drivetrain_engine_core import distributed
from drivetrain_engine_core.testing.launcher import run_distributed


def _sum_ranks(rank: int, world_size: int, scale: float) -> dict[str, object]:
    """All-reduce through the core helpers and report what the rank saw of its environment."""
    distributed.init_distributed("cpu")  # must be a no-op: the launcher already initialised the group
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return {
        "sum": tensor.item() * scale,
        "rank": distributed.rank(),
        "world": distributed.world_size(),
        "env": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]),
        "pid": os.getpid(),
    }


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    dist.barrier()  # rank 0 waits on a barrier rank 1 never reaches; the launcher must not wait for it


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_results_come_back_in_rank_order_with_torchrun_environment() -> None:
    results = run_distributed(_sum_ranks, 2.0, world_size=2)
    assert [r["sum"] for r in results] == [6.0, 6.0]  # (1 + 2) * 2 on both ranks
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["world"] for r in results] == [2, 2]
    assert [r["env"] for r in results] == [("0", "0", "2"), ("1", "1", "2")]
    assert len({r["pid"] for r in results}) == 2


def test_failing_rank_reports_its_traceback() -> None:
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one exploded on purpose"
    ):
        run_distributed(_fail_on_rank_one, world_size=2, timeout_s=120)
    assert time.monotonic() - started < 60


def test_hanging_rank_fails_within_timeout_and_is_killed() -> None:
    started = time.monotonic()
    # Rank 1 is normally done by the deadline, but on a loaded machine its start-up alone may outlast it.
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0(, 1)?\] of 2 did not finish within 15 s"):
        run_distributed(_hang_on_rank_zero, world_size=2, timeout_s=15)
    elapsed = time.monotonic() - started
    assert elapsed < 15 + 15
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("drivetrain-rank")]
