"""One rank of a job command, however it was started (this process, torchrun, ``--nproc``, a Ray actor): the
run folder agreed and checked, the job run, rank 0's closing lines returned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .run_options import RunOptions


def run_rank(config: Any, job: type, output_dir: str, run: RunOptions) -> str | None:
    """Run this process's rank of ``job``; returns (rank 0) the lines saying where the results are, else
    ``None``. Ctrl-C's saved checkpoint ends it with its one line (status 130)."""
    from .interrupt import RunInterrupted, hand_over

    try:
        return run_job(config, job, output_dir, run)
    except RunInterrupted as e:  # Ctrl-C, with the checkpoint saved: its one line, status 130
        raise SystemExit(hand_over(run.command, e)) from None


def run_job(config: Any, job: type, output_dir: str, run: RunOptions) -> str | None:
    """:func:`run_rank` without its handling of Ctrl-C: a run stopped by Ctrl-C raises
    :class:`~.interrupt.RunInterrupted`, its checkpoint saved (a rank placed by Ray hands it to the driver)."""
    from drivetrain_engine_core.kit import distributed
    from transformers.utils import logging as hf_logging

    from .launch import agreed_output_dir
    from .shared_folder import check_shared_run_dir

    hf_logging.disable_progress_bar()  # one progress bar (ours) on the console
    output_dir = agreed_output_dir(output_dir, config.engine)  # one timestamp under an outer torchrun
    check_shared_run_dir(Path(output_dir))  # before anything is written: one folder every rank sees
    instance = job(config, output_dir, resume=run.resume, overwrite=run.overwrite)
    result = instance.run()
    return instance.report(result) if distributed.rank() == 0 else None


__all__ = ["run_job", "run_rank"]
