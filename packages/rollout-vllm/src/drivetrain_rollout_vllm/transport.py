"""Where the vLLM server listens: a Unix socket on the trainer's machine, or TCP for a server on another one.

The server's first argument names it: a socket path (the default: the trainer starts the server beside itself,
in a private 0700 folder), or ``tcp://HOST/PATH``: listen on ``HOST`` at a port the OS picks, and report
``[host, port]`` in the file ``PATH`` once listening (the server's own folder, which the launcher reads on the
server's node). Either way ``multiprocessing.connection`` authenticates the trainer by an HMAC challenge on the
run's random key (the key itself never crosses the socket, and reaches the server through its environment, not
its argv), and frames the messages.

NOTE: over TCP anyone who reaches the port may knock; a peer that fails the challenge (a wrong key, a port
scanner) is refused and the server keeps listening for its trainer, so a stranger cannot end the run's server.
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from urllib.parse import urlsplit

TCP = "tcp://"
"""The prefix of the server's TCP address argument, ``tcp://HOST/PATH``."""

Address = str | tuple[str, int]
"""What the trainer connects to: a socket path, or ``(host, port)``."""


def tcp_argument(host: str, report: Path) -> str:
    """The server's argument for TCP on ``host`` (a name or an IPv4 address: ``multiprocessing.connection``
    listens on ``AF_INET`` only), its port reported in ``report`` (an absolute path)."""
    return f"{TCP}{host}{report}"


def listen(argument: str, key: bytes) -> Listener:
    """The server's listener on the socket path or ``tcp://HOST/PATH`` ``argument`` (the port reported in PATH,
    written whole, once it listens)."""
    if not argument.startswith(TCP):
        return Listener(argument, family="AF_UNIX", authkey=key)
    parts = urlsplit(argument)
    if not parts.hostname:
        raise ValueError(f"{argument!r} names no host to listen on (tcp://HOST/PATH)")
    listener = Listener((parts.hostname, 0), family="AF_INET", authkey=key)
    report = Path(parts.path)
    partial = report.with_suffix(".partial")
    partial.write_text(json.dumps(list(listener.address)))
    os.replace(partial, report)  # the reader sees the whole address or none
    return listener


def accept_trainer(listener: Listener) -> Connection:
    """The first connection that answers the key's challenge; the ones that do not are refused (one line on
    the server's log each) and the server listens on."""
    while True:
        try:
            return listener.accept()
        except (AuthenticationError, EOFError, ConnectionError) as e:
            print(
                f"refused a connection that did not authenticate ({type(e).__name__}: {e})", file=sys.stderr
            )


def reported_address(report: Path) -> Address | None:
    """The ``(host, port)`` a TCP server reported in ``report``; None before it listens."""
    try:
        host, port = json.loads(report.read_text())
    except FileNotFoundError:
        return None
    return str(host), int(port)
