"""The skip/divergence policy: an optimizer update whose global gradient norm is not finite is skipped, and a
run that skips too many in a row stops with an error that names the fixes."""

from __future__ import annotations

import logging
import math

from ._errors import DivergenceError

logger = logging.getLogger(__name__)


class SkipPolicy:
    """Counts skipped optimizer updates: over the run and the current streak (both saved in checkpoints, so
    that ``optimizer.max_consecutive_skips`` counts across a resume).

    Args:
        max_consecutive: stop after this many skipped updates in a row (``None``: never).
    """

    def __init__(self, max_consecutive: int | None) -> None:
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        self.consecutive_skips = 0

    def admit(self, grad_norm: float) -> bool:
        """Whether the update with this norm goes ahead; a non-finite one is counted and logged instead."""
        if math.isfinite(grad_norm):
            self.consecutive_skips = 0
            return True
        self.skipped_steps += 1
        self.consecutive_skips += 1
        logger.warning(
            "grad norm is %s: skipping this optimizer update (%d skipped so far)",
            grad_norm,
            self.skipped_steps,
        )
        return False

    def raise_if_diverged(self, grad_norm: float) -> None:
        """Raise when the streak of skipped updates reached ``max_consecutive``.

        Raises:
            DivergenceError: naming the streak, the last norm and the options that help.
        """
        limit = self.max_consecutive
        if limit is not None and self.consecutive_skips >= limit:
            raise DivergenceError(
                f"{self.consecutive_skips} optimizer updates in a row had a non-finite grad norm (last: "
                f"{grad_norm}) and were skipped: the run diverged. Lower optimizer.lr, set optimizer.clip_grad, "
                "check the data for broken rows, or raise optimizer.max_consecutive_skips."
            )

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counts (a checkpoint without them starts from zero)."""
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
