"""The vLLM server of the separate placement: ``python -m drivetrain_rollout_vllm.server ADDRESS MODEL DEVICE``,
run in the vLLM environment by the trainer's ``vllm-server`` rollout (:mod:`.client`, :mod:`.launch`), never by
hand.

It serves one trainer over one authenticated socket (:mod:`.process`): a Unix socket at ``ADDRESS``, or TCP for
``tcp://HOST/PATH`` (:mod:`.transport`), and ends when the trainer closes it.
NOTE: the trainer's rollout owns the contract's sequence (version bookkeeping, stale/partial/reordered streams,
verification schedule: core's ``Rollout.update_weights``); the server runs the colocated rollout's hooks on
its own vLLM, one request at a time. Buckets are checked against their digests on arrival (core's
``check_arrived``, as the trainer's template did before sending: the socket and the wire format are a second hop)
and applied layer by layer as they arrive, as the colocated rollout does (a refused bucket applies nothing, but
the layers of the buckets before it are in place: the trainer's rollout then refuses to generate until a
complete version arrives; an adapter stream is held aside until its last bucket, so after a failure the previous
adapter version serves on, as the trainer's rollout learns by asking). Read-backs go one layer at a time through the rollout's verification reader.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import version as installed_version
from multiprocessing.connection import Connection
from typing import Any

from drivetrain_engine_core.backend import ConfigError, EngineStateError
from drivetrain_engine_core.rollout import HandoffError, SamplingConfig, VerifyConfig

from .options import VLLMOptions
from .transport import accept_trainer, listen
from .wire import (
    AUTHKEY_VARIABLE,
    DISTRIBUTION,
    PROTOCOL,
    bucket_from,
    check_arrived,
    error_reply,
    tensor_fields,
)


class Server:
    """Answers the trainer's requests with one :class:`~.rollout.VLLMRollout` (built by ``start``)."""

    def __init__(self, connection: Connection, model_path: str, device: str) -> None:
        self.connection, self.model_path, self.device = connection, model_path, device
        self._rollout: Any = None
        self._handlers: dict[str, Callable[..., Any]] = {
            "start": self.start,
            "load_bucket": self.load_bucket,
            "finish_update": lambda: self.rollout._finish_update(),
            "abort_update": lambda: self.rollout._abort_update(),
            "serves_previous_version": lambda: self.rollout._serves_previous_version(),
            "drop_caches": lambda: self.rollout._drop_caches(),
            "served_weights": self.served_weights,
            "generate": self.generate,
            "sleep": lambda: self.rollout._sleep(),
            "wake": lambda: self.rollout._wake(),
        }

    def serve(self) -> None:
        """Answer requests until the trainer closes the connection (or exits)."""
        while True:
            try:
                op, args = self.connection.recv()
                payload = self.connection.recv_bytes() if op == "load_bucket" else None
            except (EOFError, OSError):
                return
            try:
                handler = self._handlers[op]
                reply: tuple = ("ok", handler(*args, payload) if payload is not None else handler(*args))
            except Exception as e:  # reported to the trainer, which raises it; the server goes on serving
                reply = error_reply(e)
            self.connection.send(reply)

    @property
    def rollout(self) -> Any:
        if self._rollout is None:
            raise EngineStateError("the vLLM server was asked to work before 'start' built its rollout.")
        return self._rollout

    def start(
        self, protocol: int, trainer_version: str, options: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """Check the trainer speaks this server's protocol, then start vLLM with ``options`` (the fields of a
        :class:`.options.VLLMOptions`; or, started before with the same, serve the checkpoint again); returns
        what runs here.

        Raises:
            HandoffError: another protocol (``options`` is optional so that an older trainer gets this error).
            ConfigError: a server started with other vLLM options (they are fixed when vLLM starts).
        """
        here = installed_version(DISTRIBUTION)
        if protocol != PROTOCOL:
            raise HandoffError(
                f"the trainer's {DISTRIBUTION} {trainer_version} speaks weight-stream protocol {protocol}, this "
                f"vLLM server's {here} protocol {PROTOCOL}: install the same {DISTRIBUTION} version in both "
                "environments."
            )
        wanted = VLLMOptions(**(options or {}))
        if self._rollout is None:
            from .rollout import VLLMRollout

            # The trainer's rollout verifies on its schedule by reading back through served_weights.
            self._rollout = VLLMRollout(
                model_path=self.model_path,
                device=self.device,
                verify=VerifyConfig(mode="never"),
                options=wanted,
            )
        elif self._rollout.options != wanted:
            raise ConfigError(
                f"this vLLM server started with {self._rollout.options}, not {wanted}; vLLM takes its options at "
                "start: start a server for these (build the rollout without server=)."
            )
        else:
            # A new trainer-side rollout on this server expects what a fresh one serves: the checkpoint.
            self._rollout.restore_checkpoint()
        import torch
        import vllm

        return {"rollout_vllm": here, "vllm": vllm.__version__, "torch": torch.__version__}

    def load_bucket(self, header: dict[str, Any], payload: bytearray) -> None:
        bucket = bucket_from(header, payload)
        check_arrived(bucket)
        self.rollout._load_bucket(bucket)

    def served_weights(self, names: Sequence[str] | None) -> dict[str, tuple[list[int], str, bytes]]:
        """What vLLM computes with under each name (every checkpoint tensor for ``None``), as
        :func:`.wire.tensor_fields`; read a layer at a time, which the trainer's verification, asking for one
        tensor after another, reads once."""
        wanted = sorted(self.rollout.checkpoint_names) if names is None else names
        served = ((name, self.rollout._served_tensor(name)) for name in wanted)
        return {name: tensor_fields(tensor) for name, tensor in served if tensor is not None}

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any]
    ) -> tuple[list[list[int]], list[list[float]]]:
        responses, log_probs = self.rollout._generate(prompts, SamplingConfig(**sampling))
        return [r.tolist() for r in responses], [lp.tolist() for lp in log_probs]


def main(argv: Sequence[str] | None = None) -> None:
    """Listen where the trainer named, serve the one trainer that connects with its key, then exit."""
    address, model_path, device = argv if argv is not None else sys.argv[1:]
    key = bytes.fromhex(os.environ.pop(AUTHKEY_VARIABLE))
    with listen(address, key) as listener:
        connection = accept_trainer(listener)
    with connection:
        Server(connection, model_path, device).serve()


if __name__ == "__main__":
    main()
