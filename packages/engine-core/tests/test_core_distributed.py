"""Process groups as a GPU run builds them: a CPU backend beside the device one, collectives at any world size,
and checks that fail on one rank failing every rank."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from drivetrain_engine_core.backend import BatchError, ConfigError
from drivetrain_engine_core.job import agreed_checks
from drivetrain_engine_core.kit import distributed
from drivetrain_engine_core.testing.launcher import run_distributed


def test_every_device_gets_a_cpu_backend_for_host_scalars() -> None:
    # An nccl-only group rejects CPU tensors: "No backend type associated with device type cpu".
    assert distributed.backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert distributed.backend_for("cpu") == "cpu:gloo"
    with pytest.raises(ConfigError, match=r"engine.device='npu' .* supported devices: \['cpu', 'cuda'\]"):
        distributed.backend_for("npu")


def _count_all_reduces(monkeypatch_target: list[int]):
    real = dist.all_reduce

    def counting(*args, **kwargs):
        monkeypatch_target.append(1)
        return real(*args, **kwargs)

    return counting


def _agreed_failure(rank: int) -> str:
    try:
        with agreed_checks():
            if rank == 1:
                raise BatchError("input_ids of sequence 3 is empty")
    except BatchError as e:
        return str(e)
    return "no error"


def _group_without_cpu_backend() -> str:
    """A group created outside drivetrain with no CPU backend (as ``init_process_group("nccl")`` would)."""
    dist.destroy_process_group()
    dist.init_process_group(
        backend="cuda:gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        distributed.init_distributed("cpu")
    except ConfigError as e:
        return str(e)
    return "accepted"


def _cpu_group_for_a_cuda_engine() -> str:
    """A group made for the CPU (a CPU test or job first), then an engine on CUDA in the same process."""
    dist.destroy_process_group()
    dist.init_process_group(
        backend=distributed.backend_for("cpu"),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    distributed.require_device = lambda device: None  # as if a GPU were visible
    try:
        distributed.init_distributed("cuda")
    except ConfigError as e:
        return str(e)
    return "accepted"


def _rank_main(rank: int, world_size: int) -> dict[str, object]:
    calls: list[int] = []
    dist.all_reduce = _count_all_reduces(calls)  # type: ignore[assignment]
    own = dist.new_group([0]), dist.new_group([1])  # every rank creates every group, in order
    alone = own[rank]
    sums = distributed.all_reduce_sums([rank + 1, 10], None)
    maxes = distributed.all_reduce_maxes([rank, -rank], None)
    lonely = distributed.all_reduce_sum(rank + 5, alone)
    return {
        "config": dist.get_backend_config(),
        "subgroup_config": dist.get_backend_config(alone),
        "sums": sums,
        "maxes": maxes,
        "lonely": lonely,
        "all_reduce_calls": len(calls),
        "agreed": _agreed_failure(rank),
        "foreign_group": _group_without_cpu_backend() if rank == 0 else "",
        "cpu_group_for_cuda": _cpu_group_for_a_cuda_engine() if rank == 0 else "",
    }


@pytest.mark.slow
def test_groups_collectives_and_agreed_errors_on_two_ranks() -> None:
    per_rank = run_distributed(_rank_main, world_size=2, timeout_s=120)
    for rank, result in enumerate(per_rank):
        assert result["config"] == "cpu:gloo"  # built by init_distributed, as engines build it
        assert result["subgroup_config"] == "cpu:gloo"
        assert result["sums"] == [3.0, 20.0]
        assert result["maxes"] == [1.0, 0.0]
        assert result["lonely"] == rank + 5
        # A one-rank group reduces nothing: its sum is the rank's own value, without a collective's cost.
        assert result["all_reduce_calls"] == 2  # the sums and the maxes
        assert result["agreed"] == "rank 1 (of failing ranks 1): input_ids of sequence 3 is empty"
    assert "backend 'cuda:gloo', which has no CPU backend" in per_rank[0]["foreign_group"]
    assert "init_process_group(backend='cpu:gloo,cuda:nccl')" in per_rank[0]["foreign_group"]
    assert "backend 'cpu:gloo', which has no CUDA backend" in per_rank[0]["cpu_group_for_cuda"]


def test_a_device_this_process_cannot_see_is_one_error_naming_the_fix(monkeypatch) -> None:
    """Regression: ``engine.device=cuda`` without a GPU ended in NCCL's "nccl2 requires at least one CUDA
    device" traceback; more ranks per node than GPUs in an "invalid device ordinal" one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"engine.device='cuda', but this process sees no cuda device.*engine.device=cpu"
    ):
        distributed.init_distributed("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"local rank 1 .* only 1 cuda device\(s\).*--nproc-per-node 1"):
        distributed.init_distributed("cuda")
    distributed.require_device("cpu")  # the host is always there


def test_the_group_is_destroyed_before_the_interpreter_exits() -> None:
    """The default group is destroyed while the interpreter is alive (torch warns about one left to exit).
    Checked in a child process by an exit handler registered before the group exists (handlers run
    last-registered first)."""
    import subprocess
    import sys

    child = (
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
        "from drivetrain_engine_core import _distributed as distributed\n"
        "distributed.init_distributed('cpu')\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "initialized at exit: False" in result.stdout
