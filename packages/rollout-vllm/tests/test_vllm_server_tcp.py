"""The server's TCP transport (a server on another machine than its trainer): the server listens on the host it
is given at a port the OS picks and reports it; a peer with the wrong key is refused and the server listens on
for its trainer, which it then serves over TCP; the key is on no argv.

The server is the real one, in this Python: it imports vLLM only when asked to start it, and the request here
(generate before start) is answered with the server's refusal, so no vLLM is needed and the test runs in the main
suite (about two seconds of CPU: the server's imports)."""

from __future__ import annotations

import secrets
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest
from drivetrain_engine_core.backend import EngineStateError
from drivetrain_rollout_vllm.launch import ServerCommand
from drivetrain_rollout_vllm.process import ServerProcess

START_SECONDS = 120


def test_a_tcp_server_refuses_a_wrong_key_and_serves_its_trainer(tmp_path):
    knocked = []

    def start_on_tcp_and_knock(command: ServerCommand):
        """Start the server on TCP at 127.0.0.1; before the trainer connects, a peer with another key knocks."""
        server = command.start(host="127.0.0.1")
        deadline = time.monotonic() + START_SECONDS
        while (address := server.address()) is None:
            assert server.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        with pytest.raises(AuthenticationError):
            Client(address, authkey=secrets.token_bytes(32))
        knocked.append((address, server.process.args, repr(command), command.key))
        return server

    server = ServerProcess.start(
        python=sys.executable, model_path=str(tmp_path), device="cpu", launch=start_on_tcp_and_knock
    )
    [(address, argv, described, key)] = knocked
    try:
        host, port = address
        assert (host, server.connection is not None) == ("127.0.0.1", True) and port > 0
        assert argv[3] == f"tcp://127.0.0.1{server.log.parent / 'server.address'}"
        assert key.hex() not in " ".join(argv) + described
        with pytest.raises(EngineStateError, match="asked to work before 'start' built its rollout"):
            server.call("generate", [[1, 2, 3]], {}, what="generating", seconds=START_SECONDS)
        assert (
            "refused a connection that did not authenticate (AuthenticationError" in server.process.log_tail()
        )
    finally:
        server.close()
    assert server.process.returncode == 0 and not server.log.parent.exists()
