"""The vLLM server as seen from the trainer: a process in vLLM's own Python, one authenticated socket, and
waits that notice the process dying.

NOTE: the transport is the standard library's ``multiprocessing.connection`` over a Unix socket in a private
directory, or over TCP for a server a launcher started on another machine (:mod:`.transport`, :mod:`.launch`):
it frames messages, authenticates the peer (HMAC challenge on a random key) and sends large byte
buffers without pickling them (``send_bytes``/``recv_bytes``). It is in both Pythons whatever their torch, so the
vLLM environment needs no extra package and the workspace lock no new one (pyzmq, which vLLM uses itself, would
add a dependency to the trainer side for the same framing). Every request, its sends and its receive, and the
connection at start run under one deadline each (:mod:`.deadline`), watched by :class:`.watch.RequestWatch`: a
server that dies is named within about a second, one that hangs alive (stopped, deadlocked, no longer reading)
when the deadline passes, and stopped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from drivetrain_engine_core.backend import ConfigError, PluginError

from .deadline import REQUEST_SECONDS_OPTION
from .install import INSTALL
from .launch import Launch, ServerCommand, ServerHandle, launcher, server_environment
from .watch import RequestWatch
from .wire import RolloutServerError, raise_error

PYTHON_VARIABLE = "DRIVETRAIN_VLLM_PYTHON"
"""The environment variable naming the Python of the vLLM environment (``.venv-vllm/bin/python``)."""

START_SECONDS = 600.0
"""How long vLLM may take to start (about 11 s for a tiny model on an idle CPU; much longer under load)."""

VLLM_CHECK_SECONDS = 120.0
"""How long the named Python may take to import vLLM when it is checked (a few seconds on a loaded CPU)."""


def server_python() -> str:
    """The Python that runs the server: ``$DRIVETRAIN_VLLM_PYTHON`` (checked: :func:`require_named_python`),
    else this one if it has vLLM.

    Raises:
        PluginError: the variable names no Python that imports vLLM.
        ConfigError: the variable is unset and this Python has no vLLM; the message says how to build an
            environment that has it and point at its Python.
    """
    named = require_named_python()
    if named is not None:
        return named
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ConfigError(
        f"rollout 'vllm-server' runs vLLM in its own Python, and none is set: {INSTALL}; then set "
        f"{PYTHON_VARIABLE} to that environment's Python (e.g. .venv-vllm/bin/python)."
    )


def require_named_python() -> str | None:
    """The Python ``$DRIVETRAIN_VLLM_PYTHON`` names, refused unless it imports vLLM (with the server's
    environment); None where the variable is unset. The client's module calls this on import, so a run with
    ``rollout.name=vllm-server`` stops when the rollout is looked up (before any warm start), as ``vllm`` does
    without vLLM (:func:`.install.require_vllm`).

    Raises:
        PluginError: the variable names no file, or a Python that cannot import vLLM (its error is quoted) or
            takes over :data:`VLLM_CHECK_SECONDS` to; the message says how to build the vLLM environment.
    """
    named = os.environ.get(PYTHON_VARIABLE)
    if not named:
        return None
    if not Path(named).is_file():
        raise PluginError(_no_vllm_python(named, "is not a file"))
    _require_vllm_in(named)
    return named


@functools.cache  # one check per Python a process names (a refusal is not cached: it is raised)
def _require_vllm_in(python: str) -> None:
    try:
        done = subprocess.run(
            [python, "-c", "import vllm"],
            env=server_environment(),
            capture_output=True,
            text=True,
            timeout=VLLM_CHECK_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise PluginError(
            _no_vllm_python(python, f"did not import vllm within {VLLM_CHECK_SECONDS:.0f} s")
        ) from None
    except OSError as e:
        raise PluginError(_no_vllm_python(python, f"does not run ({e})")) from e
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise PluginError(_no_vllm_python(python, f"cannot import vllm ({last})"))


def _no_vllm_python(python: str, happened: str) -> str:
    return (
        f"rollout 'vllm-server' runs vLLM in the Python {PYTHON_VARIABLE} names, and {PYTHON_VARIABLE}={python} "
        f"{happened}; point {PYTHON_VARIABLE} at the vLLM environment's Python "
        "(packages/rollout-vllm/scripts/make-env builds .venv-vllm/bin/python)."
    )


def check_serves(server: ServerProcess, model_path: str, device: str) -> None:
    """Refuse to hand a rollout of ``model_path`` on ``device`` a server started for another.

    Raises:
        ConfigError: naming what the server serves and what was asked.
    """
    if (server.model_path, server.device) != (model_path, device):
        raise ConfigError(
            f"{server.name} serves {server.model_path} on {server.device}, not {model_path} on {device}; "
            "start a server for that model (build the rollout without server=)."
        )


class ServerProcess:
    """One vLLM server: started with :meth:`start`, asked with :meth:`call`, ended with :meth:`close`.

    ``process`` is the server's handle (:class:`.launch.LocalServer`, or a launcher's for a server elsewhere).
    """

    def __init__(self, process: ServerHandle, python: str, model_path: str, device: str) -> None:
        self.process, self.python = process, python
        self.model_path, self.device = model_path, device
        self.connection: Connection | None = None

    @classmethod
    def start(
        cls,
        *,
        python: str,
        model_path: str,
        device: str,
        seconds: float = START_SECONDS,
        launch: Launch | None = None,
    ) -> ServerProcess:
        """Start the server in ``python`` by ``launch`` (default: :func:`.launch.launcher`'s) and connect to it
        within ``seconds``.

        Raises:
            RolloutServerError: the server exited, or did not take the connection within ``seconds`` (then it
                is stopped).
        """
        key = secrets.token_bytes(32)
        command = ServerCommand(python=python, model_path=model_path, device=device, key=key)
        server = cls((launch or launcher())(command), python, model_path, device)
        server._connect(key, seconds)
        return server

    @property
    def log(self) -> Path:
        """The server's log file (a path on the server's machine)."""
        return self.process.log

    def _connect(self, key: bytes, seconds: float) -> None:
        """Connect once the server listens; the handshake, too, ends when ``seconds`` pass (the watch stops
        the server, which breaks it off).

        Raises:
            RolloutServerError: the server exited first, did not take the connection in time, or listens where
                the trainer cannot connect (another machine's firewall).
        """
        broken: Exception | None = None
        with RequestWatch(self.process, None, seconds) as watch:
            while self.connection is None and not watch.expired:
                address = self.process.address()
                try:
                    if address is None:
                        raise ConnectionRefusedError  # a TCP server that has not reported its port yet
                    self.connection = Client(address, authkey=key)
                except (FileNotFoundError, ConnectionRefusedError):
                    if self.process.poll() is not None:
                        break
                    time.sleep(0.2)  # not listening yet
                except (EOFError, OSError) as e:
                    broken = e  # broken off mid-handshake (the server exited, or the watch stopped it), or no route
                    break
        if watch.expired:
            raise RolloutServerError(
                self._stop(f"did not take the trainer's connection within {seconds:.0f} s")
            )
        if self.connection is None:
            self._wait_for_exit()
            if broken is not None and self.process.poll() is None:
                raise RolloutServerError(
                    self._stop(f"listens at {address}, where the trainer could not connect ({broken})")
                )
            raise RolloutServerError(self.describe("exited before it took the trainer's connection"))

    def call(self, op: str, *args: Any, payload: memoryview | None = None, what: str, seconds: float) -> Any:
        """Send request ``op`` (``payload``: raw bytes that follow it) and wait for its answer.

        Args:
            what: what the request does, for the error when the server dies (``generating``).
            seconds: the request's deadline, sends and receive together; a server that has not answered by then
                (hung, or not reading what is sent) is stopped and named.

        Raises:
            RolloutServerError: the server exited, closed the connection or did not answer within ``seconds``.
            HandoffError, ConfigError, ...: the server refused the request (the same type, its message).
        """
        connection = self.connection
        if connection is None:
            raise RolloutServerError(f"{self.name} is closed; build a new rollout.")
        watch = RequestWatch(self.process, connection, seconds)
        try:
            with watch:
                connection.send((op, args))
                if payload is not None:
                    connection.send_bytes(payload)
                reply = connection.recv()
        except (EOFError, OSError) as e:
            raise RolloutServerError(self._broken(what, watch)) from e
        if watch.expired:  # the deadline passed as the answer arrived: the server is stopped all the same
            raise RolloutServerError(self._give_up(what, seconds))
        if reply[0] == "error":
            raise_error(reply[1], reply[2], server=self.name)
        return reply[1]

    def _broken(self, what: str, watch: RequestWatch) -> str:
        """The message for a request whose connection broke: the deadline passed, or the server went away."""
        if watch.expired:
            return self._give_up(what, watch.seconds)
        self._wait_for_exit()
        gone = "exited" if self.process.poll() is not None else "closed the connection"
        return self.describe(f"{gone} while {what}")

    def _give_up(self, what: str, seconds: float) -> str:
        """The message for a server that was alive but silent past its deadline, which the watch stopped (a late
        answer would be taken for the next request's, and a hung vLLM holds its memory)."""
        return self._stop(
            f"did not answer within {seconds:.0f} s while {what} (it was alive: hung, or slower than the "
            f"deadline allows; set {REQUEST_SECONDS_OPTION} to the seconds a request may take)"
        )

    def _stop(self, happened: str) -> str:
        """Drop the connection to a server the watch killed and reap it; returns the error's message."""
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.process.wait()
        return self.describe(f"{happened} and was stopped")

    def _wait_for_exit(self) -> None:
        """Give a server whose connection broke a moment to exit, so its exit code can be named."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    @property
    def name(self) -> str:
        return f"the vLLM server ({self.process.where}, {self.python})"

    def describe(self, happened: str) -> str:
        """One message: the server, what happened, its exit code, its last log lines and what to do."""
        code = self.process.poll()
        status = f" with exit code {code}" if code is not None and "exited" in happened else ""
        return (
            f"{self.name} {happened}{status}; the rollout cannot go on: restart the run (its training "
            f"checkpoints are not touched by the rollout). Last lines of {self.log}:\n{self.process.log_tail()}"
        )

    def close(self) -> None:
        """Stop the server (it shuts vLLM down when its connection closes) and reap it; its folder (socket,
        log) is removed after a clean exit and kept after a failure, whose error names the log."""
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.dispose(keep_log=self.process.returncode != 0)
