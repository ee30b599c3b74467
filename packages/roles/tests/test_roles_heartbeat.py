"""A rank stuck while alive is named when a collective times out on the others."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from drivetrain_engine_core.job import CollectiveTimeoutError
from drivetrain_engine_core.testing.launcher import run_distributed
from drivetrain_roles.runtime.heartbeat import Heartbeat


def test_describe_orders_ranks_furthest_behind_first(tmp_path: Path) -> None:
    for rank, step in ((0, 5), (1, 3)):
        Heartbeat(tmp_path, rank, 3).beat(step, "train")
    text = Heartbeat(tmp_path, 0, 3).describe()
    assert text.startswith("rank 2 never reported; rank 1 last reported step 3 ('train') ")
    assert "rank 0 last reported step 5 ('train')" in text


def _stuck_rank_one(rank: int, world_size: int, directory: str) -> str:
    heartbeat = Heartbeat(directory, rank, world_size)
    quick = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=3))
    heartbeat.beat(1, "train")
    if rank == 1:
        heartbeat.beat(1, "eval")
        time.sleep(10)  # alive, but never reaches the collective
        return "stuck"
    heartbeat.beat(2, "train")
    try:
        with heartbeat.naming_laggards():
            dist.all_reduce(torch.ones(1), group=quick)
    except CollectiveTimeoutError as e:
        return str(e)
    return "no timeout"


@pytest.mark.slow
def test_a_collective_timeout_names_the_rank_that_is_behind(tmp_path: Path) -> None:
    message = run_distributed(_stuck_rank_one, str(tmp_path), world_size=2, timeout_s=60)[0]
    assert message.startswith(
        "rank 0: a collective timed out waiting for other ranks (rank 1 last reported step 1 ('eval')"
    )
    assert "rank 0 last reported step 2 ('train')" in message
