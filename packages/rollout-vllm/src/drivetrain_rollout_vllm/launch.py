"""Starting the vLLM server process: here, as a child of the trainer, or on another machine through a launcher.

The trainer's side (:class:`.process.ServerProcess`) describes the server it wants as a :class:`ServerCommand`
(plain, picklable data) and hands it to a *launch function*: ``launch(command) -> handle``, where the handle is
what :class:`LocalServer` is (``pid``, ``poll``, ``kill``, ``wait``, ``address``, ``log``, ``log_tail``,
``where``, ``dispose``). The default launch, :meth:`ServerCommand.start`, runs the server beside the trainer on
a Unix socket. A launcher that places the server elsewhere runs ``command.start(host=...)`` where the server
should run and returns a handle that forwards to the :class:`LocalServer` it got there; the command is plain
data and the handle's methods say everything, so such a launcher needs nothing of vLLM and this package nothing
of the launcher's cluster. ``$DRIVETRAIN_SERVER_LAUNCHER`` names one as ``module:function`` (drivetrain-roles'
``trainer.ray.rollout_node=other`` sets it in each Ray rank).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import subprocess
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from drivetrain_engine_core.backend import PluginError

from .transport import Address, reported_address, tcp_argument
from .wire import AUTHKEY_VARIABLE

LAUNCHER_VARIABLE = "DRIVETRAIN_SERVER_LAUNCHER"
"""The environment variable naming the function that starts the server elsewhere (``module:function``)."""

LOG_LINES = 8
"""How many of the server's last log lines an error quotes."""

# Variables of the trainer's environment that would make vLLM's Python import the trainer's packages.
_FOREIGN = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")


def server_environment() -> dict[str, str]:
    """The server's environment: this one without the variables that point a Python at the trainer's packages."""
    return {k: v for k, v in os.environ.items() if k not in _FOREIGN}


@dataclasses.dataclass(frozen=True)
class ServerCommand:
    """The server a trainer wants: ``python -m drivetrain_rollout_vllm.server`` serving ``model_path`` on
    ``device``, authenticating its trainer by ``key`` (never on the argv; left out of the repr)."""

    python: str
    model_path: str
    device: str
    key: bytes = dataclasses.field(repr=False)

    def start(self, host: str | None = None) -> LocalServer:
        """Start the server on this machine, in a new private (0700) folder holding its socket or address
        report and its log; on a Unix socket, or on TCP at ``host`` (a port the OS picks)."""
        folder = Path(tempfile.mkdtemp(prefix="drivetrain-vllm-"))
        listen = (
            str(folder / "server.sock") if host is None else tcp_argument(host, folder / "server.address")
        )
        command = [self.python, "-m", "drivetrain_rollout_vllm.server", listen, self.model_path, self.device]
        log = folder / "server.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                env=server_environment() | {AUTHKEY_VARIABLE: self.key.hex()},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return LocalServer(process, log, tcp=host is not None)


class ServerHandle(Protocol):
    """What the trainer's side needs of a started server process, wherever it runs (:class:`LocalServer`'s
    methods say what each does)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def where(self) -> str: ...
    @property
    def log(self) -> Path: ...
    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def address(self) -> Address | None: ...
    def log_tail(self) -> str: ...
    def dispose(self, *, keep_log: bool) -> None: ...


Launch = Callable[[ServerCommand], ServerHandle]
"""A launch function: starts the server ``command`` describes and returns its handle."""


class LocalServer:
    """The server process on this machine: the handle :meth:`ServerCommand.start` returns."""

    def __init__(self, process: subprocess.Popen, log: Path, *, tcp: bool) -> None:
        self.process, self.log, self.tcp = process, log, tcp

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def where(self) -> str:
        """The process, as messages name it."""
        return f"pid {self.pid}"

    def poll(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once the process exits (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        return self.process.wait(timeout=timeout)

    def address(self) -> Address | None:
        """Where to connect: the socket's path (connecting fails until it listens), or the ``(host, port)`` it
        reported (None before)."""
        folder = self.log.parent
        return reported_address(folder / "server.address") if self.tcp else str(folder / "server.sock")

    def log_tail(self) -> str:
        """The last :data:`LOG_LINES` lines of the server's log."""
        return "".join(
            deque(self.log.read_text(errors="replace").splitlines(keepends=True), maxlen=LOG_LINES)
        )

    def dispose(self, *, keep_log: bool) -> None:
        """Remove the server's folder (socket, log) unless ``keep_log``; the process has exited."""
        if not keep_log:
            shutil.rmtree(self.log.parent, ignore_errors=True)


def launcher() -> Launch:
    """The launch function ``$DRIVETRAIN_SERVER_LAUNCHER`` names, else :meth:`ServerCommand.start` (here, on a
    Unix socket).

    Raises:
        PluginError: the variable names no function that imports (its error quoted, with the fix).
    """
    named = os.environ.get(LAUNCHER_VARIABLE)
    if not named:
        return ServerCommand.start
    module, _, name = named.partition(":")
    try:
        found: Launch = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise PluginError(
            f"{LAUNCHER_VARIABLE}={named} names no launch function ({type(e).__name__}: {e}); set it to "
            "module:function of an installed package, or unset it to start the vLLM server beside the trainer."
        ) from e
    return found
