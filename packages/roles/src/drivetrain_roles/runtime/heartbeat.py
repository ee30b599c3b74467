"""Name the rank a job is waiting for: each rank records where it is, and a collective timeout reads it.

A rank that hangs while alive (a stuck data loader, a deadlock, a slow filesystem) is bounded only by the
collective timeout, and then every other rank fails with a transport message ("Timed out waiting 300000ms
for recv operation") that names no rank. Each rank writes its last ``(step, phase, time)`` to
``<directory>/rank<R>.json`` at phase boundaries; when a collective times out on a healthy rank,
:meth:`Heartbeat.naming_laggards` turns the timeout into one :class:`CollectiveTimeoutError` that names the
rank(s) furthest behind and how long ago each was last seen. The directory must be visible to every rank
(one node, or a shared filesystem); a rank that never wrote is reported as such.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from drivetrain_engine_core.job import CollectiveTimeoutError


@dataclass(frozen=True)
class Beat:
    """Where one rank last said it was: a step, a phase (``train``, ``eval``, ``save``...) and a wall time."""

    rank: int
    step: int
    phase: str
    time: float


class Heartbeat:
    """This rank's heartbeat file and a reader of every rank's.

    Args:
        directory: where the ``rank<R>.json`` files live (created if missing).
        rank: this process's global rank.
        world_size: how many ranks write heartbeats.
    """

    def __init__(self, directory: str | Path, rank: int, world_size: int) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.directory.mkdir(parents=True, exist_ok=True)

    def beat(self, step: int, phase: str) -> None:
        """Record that this rank reached ``phase`` of ``step`` now (an atomic file replace)."""
        path = self._path(self.rank)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"step": step, "phase": phase, "time": time.time()}))
        os.replace(temporary, path)

    def beats(self) -> dict[int, Beat]:
        """The last beat of every rank that wrote one (unreadable files are skipped)."""
        found = {}
        for rank in range(self.world_size):
            try:
                record = json.loads(self._path(rank).read_text())
            except (OSError, ValueError):
                continue
            found[rank] = Beat(
                rank=rank, step=int(record["step"]), phase=str(record["phase"]), time=record["time"]
            )
        return found

    def describe(self, now: float | None = None) -> str:
        """Ranks furthest behind first: ``rank 1 last reported step 3 ('train') 42 s ago; ...``."""
        now = time.time() if now is None else now
        beats = self.beats()
        silent = [rank for rank in range(self.world_size) if rank not in beats]
        ordered = sorted(beats.values(), key=lambda b: (b.step, b.time))
        parts = [f"rank {rank} never reported" for rank in silent] + [
            f"rank {b.rank} last reported step {b.step} ({b.phase!r}) {now - b.time:.0f} s ago"
            for b in ordered
        ]
        return "; ".join(parts)

    @contextmanager
    def naming_laggards(self) -> Iterator[None]:
        """Turn a collective timeout raised inside the block into one error that names the ranks behind.

        Raises:
            CollectiveTimeoutError: a collective timed out; the message lists every rank's last beat.
        """
        try:
            yield
        except RuntimeError as e:
            if not is_collective_timeout(e):
                raise
            raise CollectiveTimeoutError(
                f"rank {self.rank}: a collective timed out waiting for other ranks ({self.describe()}). The rank "
                "furthest behind is stuck or dead: look at its log; raise engine.dist_timeout_s if that phase "
                "is legitimately slow."
            ) from e

    def _path(self, rank: int) -> Path:
        return self.directory / f"rank{rank}.json"


def is_collective_timeout(error: BaseException) -> bool:
    """Whether ``error`` is a collective that gave up waiting for its peers.

    NOTE: gloo reports a timeout as a plain ``RuntimeError`` ("Timed out waiting ...ms for recv operation");
    nccl's watchdog raises ``DistBackendError``. The message is the only mark gloo leaves.
    """
    if isinstance(error, dist.DistBackendError):
        return True
    return isinstance(error, RuntimeError) and "timed out" in str(error).lower()
