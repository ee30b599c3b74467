"""TensorBoard event files under ``<run>/tensorboard`` (needs the ``tensorboard`` package)."""

from __future__ import annotations

from .base import RunInfo, Tracker


class TensorBoardTracker(Tracker):
    """Writes each value as a scalar through torch's ``SummaryWriter``; a resumed run purges what the crashed
    run logged after the resumed step (it showed those steps twice)."""

    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if run.resume_step is None else run.resume_step + 1
        self._writer = SummaryWriter(log_dir=str(run.run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()
