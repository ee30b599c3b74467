"""A step's files hashed and checked by every rank at once, each a share balanced by size.

Rank 0 alone used to read every byte of a step to hash it (saving) and to check it (resuming) while the other
ranks waited in a collective: at 12 bytes a parameter with fp32 Adam, a 70B model's step is ~840 GB, minutes
of hashing that outlast the collective timeout, so every save (and every resume) of a large run failed. Now
each rank hashes (and fsyncs) or checks its share of the files rank 0 lists (or the manifest names) and the
results are gathered. The files must be on a filesystem every rank sees (rank 0 publishes what every rank
wrote): a rank that cannot read its share makes every rank raise, naming that requirement, where a root on
each node's own disk used to publish steps that no other node could load.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import _distributed as distributed
from .._errors import CheckpointError
from .durable import fsync_file
from .manifest import Manifest, describe_files, step_files, verify_files

T = TypeVar("T")


def share(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files of ``rank``: largest first, each to the rank with the fewest bytes so far (ties: lowest rank)."""
    loads = [(0, r) for r in range(world_size)]
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + size, owner))
        if owner == rank:
            mine.append(name)
    return mine


@dataclass(frozen=True)
class Failure:
    """What one rank reports instead of a result: the message every rank raises."""

    message: str


def attempt(action: Callable[[], T]) -> T | Failure:
    """``action()``, or the :class:`Failure` it raised, as a message: a rank's error must reach every rank (a
    rank that raised alone left the others waiting in the next collective)."""
    try:
        return action()
    except CheckpointError as e:
        return Failure(str(e))
    except FileNotFoundError as e:
        return Failure(
            f"rank {distributed.rank()} cannot find {e.filename}: the checkpoint root must be on a filesystem "
            "every rank sees (shared storage, not a node's own disk)."
        )
    except Exception as e:
        return Failure(f"rank {distributed.rank()}: {type(e).__name__}: {e}")


def raise_any(outcomes: list[object]) -> None:
    """Raise, on every rank that gathered ``outcomes``, the first :class:`Failure` among them."""
    failures = [outcome for outcome in outcomes if isinstance(outcome, Failure)]
    if failures:
        raise CheckpointError(failures[0].message)


def describe_on_every_rank(step_dir: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file of ``step_dir`` (collective): this rank fsyncs and hashes its share of
    the files rank 0 lists.

    Raises:
        CheckpointError: on every rank, when some rank failed (one that cannot find its share: a root on a
            node's own disk).
    """
    listed = distributed.broadcast_object(
        attempt(lambda: step_files(step_dir)) if distributed.rank() == 0 else None
    )
    raise_any([listed])
    assert isinstance(listed, dict)  # rank 0's listing
    mine = share(listed, distributed.rank(), distributed.world_size())

    def describe_mine() -> dict[str, dict[str, Any]]:
        for relative in mine:
            fsync_file(step_dir / relative)
        return describe_files(step_dir, mine)

    parts = distributed.all_gather_objects(attempt(describe_mine))
    raise_any(parts)
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        merged.update(part)  # type: ignore[call-overload]
    return dict(sorted(merged.items()))


def verify_on_every_rank(step_dir: Path, manifest: Manifest) -> None:
    """Check every file the manifest lists (collective): this rank checks its share; every rank raises the first
    problem any rank found, so none waits for one that failed.

    Raises:
        CheckpointError: a listed file is missing, truncated or altered, or some rank could not check its share.
    """
    sizes = {name: int(entry["size"]) for name, entry in manifest.files.items()}
    mine = set(share(sizes, distributed.rank(), distributed.world_size()))
    raise_any(distributed.all_gather_objects(attempt(lambda: verify_files(step_dir, manifest, only=mine))))
