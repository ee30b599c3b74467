"""Run a function on N local processes with ``torch.distributed`` initialised, like a tiny ``torchrun``.

Each child gets the environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``), so engines and ``init_distributed`` behave as in a real launch. The parent
collects every rank's return value; a failing rank fails the call with its traceback and a hanging rank fails
it within ``timeout_s``. Every child is killed before the call returns or raises, so nothing is left behind.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drivetrain_engine_core._processes import die_with_parent, kill_process_group

_JOIN_GRACE_S = 10.0
_EXIT_GRACE_S = 5.0  # ranks that reported get this long to exit normally before they are killed
# How long to wait for other ranks' tracebacks once one rank has failed.
_FOLLOW_UP_S = 2.0


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _module_source(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """The module name of ``fn`` and its file, so a child can import modules that are not on ``sys.path``.

    pytest's importlib mode imports test files under names the child cannot import by name; the file path
    lets the child load the same module under the same name before unpickling anything from it.
    """
    module = sys.modules.get(fn.__module__)
    return fn.__module__, getattr(module, "__file__", None)


def _import_module(name: str, file: str | None) -> None:
    """Import ``name`` normally, or from ``file`` under that name when it is not importable."""
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ImportError:
        if file is None:
            raise
        _register_parents(name)
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"run_distributed: cannot import {name!r} from {file}") from None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _register_parents(name: str) -> None:
    """Put empty parent modules in ``sys.modules``: pickle imports ``a`` before looking up ``a.b.c``."""
    parts = name.split(".")[:-1]
    for depth in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))


def _child(
    rank: int,
    world_size: int,
    env: dict[str, str],
    source: tuple[str, str | None],
    payload: bytes,
    device: str,
    timeout_s: float,
    results: Any,
) -> None:
    """Entry point of one rank: set the torchrun environment, init the group, run, report, clean up.

    The rank leads its own process group, so the parent can kill whatever it starts, and dies with the parent
    if the parent is killed outright (:func:`drivetrain_engine_core.job.die_with_parent`). The default process
    group is created exactly as engines create it in a real launch
    (:func:`drivetrain_engine_core.job.init_distributed`). The report goes on the queue before the process group
    is torn down: tearing it down makes the other ranks' collectives fail, and the parent should hear about the
    cause before the consequences.
    """
    if hasattr(os, "setsid"):
        os.setsid()
    die_with_parent()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from drivetrain_engine_core._distributed import init_distributed

    try:
        # Two shared cores: one intra-op thread per rank keeps ranks from starving each other.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        _import_module(*source)
        fn, args = pickle.loads(payload)
        init_distributed(device, timeout_s)
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # every failure must reach the parent, SystemExit and KeyboardInterrupt too
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_env(rank: int, world_size: int, port: int, env: Mapping[str, str] | None) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        **(env or {}),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def _kill_all(processes: Sequence[multiprocessing.process.BaseProcess], exit_grace_s: float = 0.0) -> None:
    """Kill every child still alive and reap them all, so no orphan survives the call.

    ``exit_grace_s`` first lets ranks that already reported exit normally, so that helper processes that
    libraries start (megatron's checkpoint writer) are shut down by their owners instead of orphaned.
    """
    deadline = time.monotonic() + exit_grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(_JOIN_GRACE_S)
        if process.pid is not None:
            kill_process_group(process.pid)  # what the rank started (writers, workers) goes with it


def _next_report(results: Any, wait_s: float) -> tuple[int, bool, Any] | None:
    try:
        return results.get(timeout=wait_s)
    except queue.Empty:
        return None


def _check_silent_deaths(processes: list[Any], values: dict[int, Any], results: Any) -> None:
    """Fail when a rank exited (e.g. killed by the OS) without putting a report on the queue."""
    dead = [r for r, p in enumerate(processes) if r not in values and p.exitcode is not None]
    if not dead:
        return
    time.sleep(0.5)  # a report may still be in flight from a rank that has just exited
    if results.empty():
        codes = {r: processes[r].exitcode for r in dead}
        raise RuntimeError(f"run_distributed: rank(s) exited without a result (exit codes {codes}).")


def _failure_message(rank: int, trace: str, world_size: int, results: Any) -> str:
    """The first failing rank's traceback, then those of ranks that failed right after (often as a result)."""
    message = f"run_distributed: rank {rank} of {world_size} failed:\n{trace}"
    deadline = time.monotonic() + _FOLLOW_UP_S
    while (wait := deadline - time.monotonic()) > 0 and (report := _next_report(results, wait)) is not None:
        if not report[1]:
            message += f"\nrank {report[0]} of {world_size} also failed:\n{report[2]}"
    return message


def _collect(processes: list[Any], results: Any, timeout_s: float) -> list[Any]:
    """Wait for one report per rank; raise on the first failure, a dead silent rank, or the deadline."""
    world_size = len(processes)
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(
                f"run_distributed: rank(s) {missing} of {world_size} did not finish within {timeout_s:.0f} s; "
                "all ranks were killed. A rank is probably waiting on a collective the others never reached."
            )
        report = _next_report(results, min(remaining, 1.0))
        if report is None:
            _check_silent_deaths(processes, values, results)
            continue
        rank, ok, data = report
        if not ok:
            raise RuntimeError(_failure_message(rank, data, world_size, results))
        values[rank] = pickle.loads(data)
    return [values[r] for r in range(world_size)]


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout_s: float = 240.0,
    env: Mapping[str, str] | None = None,
    device: str = "cpu",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return each rank's result.

    Args:
        fn: A module-level (picklable) function. Its module is imported in each child, by name or from its
            file, so functions defined in pytest test files work.
        *args: Picklable arguments passed after ``rank`` and ``world_size``.
        world_size: Number of processes.
        timeout_s: Deadline for the whole call; it is also the process-group timeout, so a collective that
            waits on a dead rank fails instead of hanging.
        env: Extra environment variables for every child (``OMP_NUM_THREADS`` defaults to 1).
        device: the engine device the process group is created for (``"cpu"``: gloo; ``"cuda"``: one GPU
            per rank, nccl for device tensors and gloo for host scalars).

    Returns:
        The return values of ranks ``0..world_size-1``, in rank order.

    Raises:
        RuntimeError: A rank raised (the message holds its traceback) or died without reporting.
        TimeoutError: Some rank did not finish within ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}.")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    payload = pickle.dumps((fn, args))
    source = _module_source(fn)
    processes = [
        context.Process(
            target=_child,
            args=(
                r,
                world_size,
                _rank_env(r, world_size, port, env),
                source,
                payload,
                device,
                timeout_s,
                results,
            ),
            name=f"drivetrain-rank{r}",
        )
        for r in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        outcome = _collect(processes, results, timeout_s)
        _kill_all(processes, exit_grace_s=_EXIT_GRACE_S)
        return outcome
    finally:
        _kill_all(processes)
        results.close()
        results.join_thread()
