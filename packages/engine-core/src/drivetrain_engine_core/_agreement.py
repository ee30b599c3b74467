"""Checks whose outcome can differ between ranks, agreed on by every rank before any rank moves on.

A batch that is malformed on one rank only, or a rank that cannot fill its micro-batches, must not leave the
other ranks blocked in their next collective until the timeout kills them with an unrelated "Connection
closed by peer". :func:`agreed_checks` runs a block of local checks on every rank, then every rank learns
whether any rank failed and, if so, raises the same error, naming the ranks and the first message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from . import _distributed as distributed
from ._config import ConfigError
from ._distributed import ProcessGroup
from ._errors import DrivetrainError

UserError = (DrivetrainError, ConfigError)
"""The errors a check reports to every rank; anything else is a bug and propagates on its own rank."""


@contextmanager
def agreed_checks(group: ProcessGroup | None = None) -> Iterator[None]:
    """Run the block's checks so that a failure on any rank of ``group`` raises on every rank.

    The block must not run collectives itself. Without failures this costs one all-reduce of one host
    number; on a failure the ranks exchange their messages once.

    Raises:
        DrivetrainError | ConfigError: of the type the first failing rank raised, on every rank, with that
            rank's message and the list of failing ranks.
    """
    local: BaseException | None = None
    try:
        yield
    except UserError as e:
        local = e
    if not distributed.all_reduce_max(0 if local is None else 1, group):
        return
    reports = distributed.all_gather_objects(None if local is None else (type(local), str(local)), group)
    failed: list[tuple[int, tuple[type[Exception], str]]] = [
        (rank, report)  # type: ignore[misc]
        for rank, report in enumerate(reports)
        if report is not None
    ]
    first_rank, (error_type, message) = failed[0]
    ranks = ", ".join(str(rank) for rank, _ in failed)
    if distributed.world_size(group) > 1:
        message = f"rank {first_rank} (of failing ranks {ranks}): {message}"
    raise error_type(message) from local
