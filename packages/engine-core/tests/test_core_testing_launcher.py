"""The test launcher: results in rank order, a failing rank's traceback, a hanging rank's timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from drivetrain_engine_core.kit import distributed
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


def _start_sleeper(rank: int, world_size: int) -> int:
    """Start a helper process, as megatron's checkpoint writer does, and leave it running."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]).pid


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped by init does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_processes_a_rank_started_are_gone_when_the_launcher_returns() -> None:
    pids = run_distributed(_start_sleeper, world_size=2, timeout_s=120)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a rank's helper process outlived run_distributed"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_ranks_die_with_a_launcher_that_is_killed_outright(tmp_path: Path) -> None:
    # The launcher is SIGKILLed while its ranks wait: nothing can clean up, so the ranks must not outlive it.
    pids = tmp_path / "pids"
    launcher = (
        "import os, sys, time\n"
        "from drivetrain_engine_core.testing.launcher import run_distributed\n"
        "def rank(r, w, path):\n"
        "    open(f'{path}.{r}', 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
        "if __name__ == '__main__':\n"
        f"    run_distributed(rank, {str(pids)!r}, world_size=2, timeout_s=600)\n"
    )
    script = tmp_path / "launch.py"
    script.write_text(launcher)
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.monotonic() + 60
    while not all(Path(f"{pids}.{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [int(Path(f"{pids}.{r}").read_text()) for r in range(2)]
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks), "a rank outlived its killed launcher"
