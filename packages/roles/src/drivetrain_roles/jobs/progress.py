"""The console progress bar every job command shows: one bar, on rank 0 only."""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core import distributed


def progress_bar(command: str, total_steps: int, start_step: int, *, enabled: bool) -> Any:
    """A tqdm bar named after ``command`` from ``start_step`` to ``total_steps`` (hidden on other ranks)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total_steps,
        initial=start_step,
        desc=command,
        unit="step",
        disable=not (enabled and distributed.rank() == 0),
    )
