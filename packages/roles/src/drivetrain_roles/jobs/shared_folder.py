"""The run folder of a launch over several nodes must be one folder: the same path, on storage every node shares.

Rank 0 writes the config, the metrics and the final model, every rank writes its checkpoint shards and its
heartbeat, and a resumed rank reads shards other ranks wrote. On storage a node does not share (a local disk
under the same path) each node would hold part of every checkpoint and no node a loadable one; a resume would
start over or fail far from the cause. :func:`check_shared_run_dir` proves the folder shared before the job
writes anything: every rank leaves a marker named by its rank and node, and rank 0 must see them all within a
bounded time (NFS caches directory listings for a few seconds); any rank that names another folder, or whose
marker rank 0 cannot see, is named in one error on every rank. The markers are removed either way, and a run
folder the check created is removed again when it fails.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from drivetrain_engine_core.backend import DrivetrainError
from drivetrain_engine_core.kit import distributed

from .nodes import DEFAULT_TIMEOUT_S, NODE_RANK_ENV, TIMEOUT_ENV

MARKERS = ".drivetrain-nodes"
"""In the run folder while the check runs: ``rank<R>-node<N>`` per rank, holding the rank's host name."""
_POLL_S = 0.05


class SharedFolderError(DrivetrainError):
    """The ranks of a launch do not share one run folder; the message names the rank, its node and the fix."""


@dataclass(frozen=True)
class _Rank:
    """Where one rank runs and which folder it was given."""

    rank: int
    node: int
    host: str
    folder: str

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, host {self.host})"

    def marker(self) -> str:
        return f"rank{self.rank}-node{self.node}"


def check_shared_run_dir(run_dir: Path) -> None:
    """Check that every rank of this launch runs in the same folder, shared by their nodes (collective; nothing
    to check in a launch of one rank).

    Raises:
        SharedFolderError: on every rank, naming the first rank that names another folder or whose marker rank
            0 could not see within ``--rdzv-timeout`` seconds.
    """
    if distributed.world_size() == 1:
        return
    me = _Rank(
        distributed.rank(),
        _node_rank(),
        socket.gethostname(),
        str(run_dir),
    )
    ranks = [r for r in distributed.all_gather_objects(me) if isinstance(r, _Rank)]
    others = [r for r in ranks if r.folder != ranks[0].folder]
    if others:
        raise SharedFolderError(
            f"{others[0].describe()} runs in {others[0].folder} but {ranks[0].describe()} in {ranks[0].folder}: "
            "pass the same --output-dir on every node, on storage they all share."
        )
    created = not run_dir.exists()
    markers = run_dir / MARKERS
    markers.mkdir(parents=True, exist_ok=True)
    (markers / me.marker()).write_text(me.host)
    distributed.barrier()
    unseen = _unseen(markers, ranks) if me.rank == 0 else None
    verdict = distributed.broadcast_object(unseen)
    (markers / me.marker()).unlink(missing_ok=True)
    distributed.barrier()
    with contextlib.suppress(OSError):  # another node's rank may still hold its own, unshared, copy
        markers.rmdir()
    if isinstance(verdict, str):
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise SharedFolderError(verdict)


def _node_rank() -> int:
    """This rank's node as its launch numbers it: drivetrain's ``--node-rank``, Slurm's node id, else torch's
    group rank (an outer torchrun's own order)."""
    for variable in (NODE_RANK_ENV, "SLURM_NODEID", "GROUP_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    return 0


def _unseen(markers: Path, ranks: list[_Rank]) -> str | None:
    """Rank 0: the error naming the first rank whose marker it cannot see within the timeout, else None."""
    deadline = time.monotonic() + float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    while True:
        missing = [r for r in ranks if not (markers / r.marker()).exists()]
        if not missing:
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    return (
        f"the run folder {markers.parent} is not shared by every node: {ranks[0].describe()} cannot see the "
        f"marker {missing[0].describe()} wrote there ({MARKERS}/{missing[0].marker()}) within "
        f"{os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)} s. Put --output-dir on storage every node mounts at "
        "the same path (NFS, Lustre, a shared volume), or raise --rdzv-timeout for storage that shows new "
        "files late."
    )


__all__ = ["MARKERS", "SharedFolderError", "check_shared_run_dir"]
