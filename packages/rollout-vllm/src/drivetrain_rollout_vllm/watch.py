"""One request to the vLLM server, watched: its deadline, or the server's exit, ends every wait on the socket.

NOTE: ``multiprocessing.connection`` reads and writes the socket with plain blocking ``os.read``/``os.write`` on
its descriptor, so no socket timeout bounds them: a bucket larger than the socket's buffer (about 208 KB) sent
to a server that stopped reading blocks ``send_bytes`` for good, and so do the receive of an answer cut off
mid-message and the handshake with a server that listens but never takes the connection. A thread beside the
request bounds them all with the request's one deadline: at the deadline it kills the server and shuts the
socket down, which wakes a blocked send (broken pipe) or receive (end of file) at once; when the server exits
it shuts the socket down too, since a process the server started (vLLM's workers) may hold the socket open
after the server's death. The caller reads :attr:`RequestWatch.expired` and :attr:`RequestWatch.exited` to name
what broke the request. The server is its handle (:mod:`.launch`): a process here, or one a launcher started on
another machine, whose handle reports it exited once its machine is lost. Re-implementing the connection's framing
over a socket with timeouts was the other way; this one keeps the standard library's framing and authentication
untouched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from multiprocessing.connection import Connection
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .launch import ServerHandle

TICK_SECONDS = 1.0
"""How often the watch checks the server process: a server that dies is named within about this long."""


class RequestWatch:
    """Watches ``process`` while one request runs on ``connection`` (None while connecting), for ``seconds``.

    Use it as a context manager around the request's sends and receives; leaving the block ends the watch.
    """

    def __init__(self, process: ServerHandle, connection: Connection | None, seconds: float) -> None:
        self.process, self.connection, self.seconds = process, connection, seconds
        self.expired = False
        """The deadline passed: the watch killed the server and shut the socket down."""
        self.exited = False
        """The server exited while the request ran: the watch shut the socket down."""
        self._done = threading.Event()
        self._lock = (
            threading.Lock()
        )  # the request ends, or the watch acts: one of the two, never both at once
        self._thread = threading.Thread(target=self._watch, name="vllm-server-request-watch", daemon=True)

    def __enter__(self) -> RequestWatch:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        with self._lock:
            self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.seconds
        while not self._done.wait(min(TICK_SECONDS, max(0.0, deadline - time.monotonic()))):
            with self._lock:
                if self._done.is_set():
                    return
                if time.monotonic() >= deadline:
                    self.expired = True
                    self.process.kill()
                elif self.process.poll() is not None:
                    self.exited = True
                else:
                    continue
                self._shut_down()
                return

    def _shut_down(self) -> None:
        """Shut the connection's socket down for both directions, waking whatever waits on it (the request
        holds the connection open until the watch ends, so its descriptor is still this socket's)."""
        if self.connection is None:
            return
        with (
            contextlib.suppress(OSError),
            socket.socket(fileno=os.dup(self.connection.fileno())) as duplicate,
        ):
            duplicate.shutdown(socket.SHUT_RDWR)
