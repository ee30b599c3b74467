"""Ctrl-C on the driver of ``trainer.placement=ray``: the first is sent on to the ranks, which stop after the
current step with a checkpoint (as under ``--nproc``); a second stops every rank at once.

Ray's ranks run in processes of the raylets, on other nodes, so the terminal's Ctrl-C reaches the driver only.
Each rank's actor has an inbox folder on its node (its :data:`~.rank_failures.ERROR_DIR_ENV`), where its step
loop leaves its process id while it takes a stop request (:class:`~.interrupt.StopRequests`). The driver's
handler only notes the first Ctrl-C (Ray's client is not safe to call inside a signal handler); the driver's
watch loop then starts one small Ray task on each rank's node that sends SIGINT to that rank when it is in its
loop (:func:`~.interrupt.send_ctrl_c`). When no rank is in its loop there is nothing to save, and every rank is
stopped at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import FrameType

from .interrupt import say_forwarded, sigint_taken_by


class DriverCtrlC:
    """The driver's Ctrl-C while the ranks run: the first noted, then :meth:`forward`-ed; a second raises
    ``KeyboardInterrupt``.

    Args:
        command: the command's name, for the line the forwarded Ctrl-C prints.
    """

    def __init__(self, command: str) -> None:
        self.command = command
        self.requested = False
        self.forwarded = False

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Handle SIGINT inside the block (in the main thread only: elsewhere Python cannot)."""
        with sigint_taken_by(self._handle):
            yield

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def forward(self, send: Callable[[], bool]) -> None:
        """Send a noted Ctrl-C on to the ranks once (``send``: whether a rank in its loop took it).

        Raises:
            KeyboardInterrupt: no rank is in its step loop, so none can save: every rank stops at once.
        """
        if not self.requested or self.forwarded:
            return
        self.forwarded = True
        if not send():
            raise KeyboardInterrupt
        say_forwarded(self.command)


__all__ = ["DriverCtrlC"]
