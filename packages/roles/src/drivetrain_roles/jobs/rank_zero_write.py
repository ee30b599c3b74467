"""Files only rank 0 writes (the final model, a reward model's start), with the outcome agreed on by every rank.

Rank 0 writing alone while the others waited at a barrier left them blocked until the collective timeout when
the write failed (a full disk, a quota, a reward head a sequence-classification model cannot hold): rank 0 had
the error, the others an unrelated transport error minutes later. The block runs inside core's
``agreed_checks``, so every rank raises the same one-line error, and nothing is lost: the weights are in the
run's last checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from drivetrain_engine_core.backend import CheckpointError
from drivetrain_engine_core.job import agreed_checks


@contextmanager
def rank_zero_write(what: str, target: Path) -> Iterator[None]:
    """Run rank 0's writing of ``what`` to ``target`` (the block tests the rank itself); collective.

    Raises:
        CheckpointError: the write failed on rank 0 (an ``OSError``, named with the fix), on every rank.
        DrivetrainError | ConfigError: the block's own refusal, on every rank.
    """
    with agreed_checks():
        try:
            yield
        except OSError as e:
            raise CheckpointError(
                f"could not write {what} to {target}: {e}. Free space or choose another --output-dir; the run's "
                "last checkpoint holds the weights (`drivetrain ckpt merge` writes them as a Hugging Face folder)."
            ) from e


__all__ = ["rank_zero_write"]
