"""The console progress bars of a job: the steps' bar every command shows, and the held-out generation's, on
rank 0 only."""

from __future__ import annotations

from typing import Any

from drivetrain_engine_core.kit import distributed


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


def generation_progress(total_tokens: int, *, enabled: bool) -> Any:
    """A bar of the held-out generation's new tokens, up to ``total_tokens`` (a greedy batch generates one per
    step for every row and may end sooner, at every row's stop token), drawn at every update (SFT's and DPO's:
    each decoding step; GRPO's and PPO's: each ``generate`` call, :mod:`..rl.held_out`). Hidden on other ranks,
    when ``enabled`` (``trainer.progress_bar``) is off and where stderr is not a terminal; cleared when done, so
    the steps' bar and the evaluation's line stay as they were."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total_tokens,
        desc="evaluation: generating",
        unit="token",
        leave=False,
        mininterval=0,
        miniters=1,
        disable=None if enabled and distributed.rank() == 0 else True,
    )
