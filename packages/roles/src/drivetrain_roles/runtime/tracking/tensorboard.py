"""TensorBoard event files under ``<run>/tensorboard`` (needs the ``tensorboard`` package)."""

from __future__ import annotations

from .base import RunInfo, Tracker


class TensorBoardTracker(Tracker):
    """Writes each value as a scalar through torch's ``SummaryWriter``.

    A resumed run purges what the crashed run logged after the resumed step (it showed those steps twice); a new
    run purges from step 0, so that event files an earlier run left in the directory (``--overwrite``, or a run
    that stopped before its first checkpoint) drop out of TensorBoard's view instead of mixing into the curves.
    TensorBoard applies a purge when it reads the new event file after the older ones.
    """

    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = 0 if run.resume_step is None else run.resume_step + 1
        self._writer = SummaryWriter(log_dir=str(run.run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def sync(self) -> None:
        """Write pending events to the event file (before a checkpoint): ``SummaryWriter`` flushes every 120 s,
        so a run killed after a checkpoint lost the steps before it, which its resume never logs again."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
