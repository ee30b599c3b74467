"""What crosses the socket between the trainer's ``vllm-server`` rollout and the vLLM server process.

The two ends run different Pythons (the trainer's torch 2.15, vLLM's 2.13), so nothing torch-specific is
pickled: messages are plain Python values (``multiprocessing.connection`` frames and authenticates them), a
bucket travels as a header of plain values plus its buffer as raw bytes (``send_bytes``), and dtypes by name.
The server checks a bucket's digests when it arrives (core's ``check_arrived``), before it applies anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from drivetrain_engine_core.backend import ConfigError, DrivetrainError, EngineStateError, PluginError
from drivetrain_engine_core.rollout import (
    DeltaBaseError,
    HandoffError,
    SamplingConfig,
    TensorDigest,
    TensorSpec,
    WeightBucket,
    as_bytes,
)
from drivetrain_engine_core.rollout import check_arrived as check_arrived_in_core

DISTRIBUTION = "drivetrain-rollout-vllm"

PROTOCOL = 4
"""The message format's version: both ends must speak the same one (raised on any incompatible change; 2: the
start request carries the vLLM options; 3: the trainer asks the server to drop its caches, ``drop_caches``,
once a new version's weights are in place, which a protocol-2 server would not do; 4: the options carry the
LoRA settings, ``enable_lora`` ..., which a protocol-3 server cannot build)."""

PROTOCOL_1_START = "failed with TypeError: Server.start() takes 3 positional arguments but 4 were given"
"""How a protocol-1 server (drivetrain-rollout-vllm 0.2.0) answers a protocol-2 start request: it fails on the
options argument before it compares protocols."""

AUTHKEY_VARIABLE = "DRIVETRAIN_VLLM_SERVER_AUTHKEY"
"""The environment variable that hands the server its connection's secret (hex), so it is not on its argv."""


class CorruptedBucketError(HandoffError):
    """A bucket arrived with other bytes than its sender's digests (:func:`check_arrived`): the transport's
    fault, not the stream's, so the sender may send the same bucket again (nothing of it was applied)."""


ERRORS: dict[str, type[Exception]] = {
    error.__name__: error
    for error in (
        HandoffError,
        CorruptedBucketError,
        DeltaBaseError,
        ConfigError,
        PluginError,
        EngineStateError,
        ValueError,
    )
}
"""The errors the server reports as themselves: the trainer raises the same type with the server's message."""


def dtype_of(name: str) -> torch.dtype:
    """``torch.float32`` from ``"torch.float32"`` (or ``"float32"``)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise HandoffError(f"the weight stream names dtype {name!r}, which this torch does not have.")
    return dtype


def _digest_fields(held: TensorDigest) -> dict[str, Any]:
    return {"name": held.name, "shape": list(held.shape), "dtype": str(held.dtype), "digest": held.digest}


def _digest(fields: dict[str, Any]) -> dict[str, Any]:
    return {**fields, "shape": tuple(fields["shape"]), "dtype": dtype_of(fields["dtype"])}


def bucket_header(bucket: WeightBucket) -> dict[str, Any]:
    """Everything of ``bucket`` but its buffer, as plain values."""
    return {
        "version": bucket.version,
        "index": bucket.index,
        "last": bucket.last,
        "lora": bucket.lora,
        "base_version": bucket.base_version,
        "adapter_config": None if bucket.adapter_config is None else dict(bucket.adapter_config),
        "specs": [{**_digest_fields(spec), "offset": spec.offset} for spec in bucket.specs],
        "unchanged": [_digest_fields(held) for held in bucket.unchanged],
    }


def bucket_bytes(bucket: WeightBucket) -> memoryview:
    """The bucket's buffer as bytes to send (copied to host memory when it lives on an accelerator)."""
    return memoryview(bucket.buffer.detach().cpu().contiguous().numpy().data).cast("B")


def bucket_from(header: dict[str, Any], payload: bytearray) -> WeightBucket:
    """The bucket the trainer sent, its buffer on the bytes received (no copy)."""
    buffer = torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    return WeightBucket(
        version=header["version"],
        index=header["index"],
        last=header["last"],
        lora=header["lora"],
        base_version=header["base_version"],
        adapter_config=header["adapter_config"],
        specs=tuple(TensorSpec(**_digest(spec)) for spec in header["specs"]),
        unchanged=tuple(TensorDigest(**_digest(held)) for held in header["unchanged"]),
        buffer=buffer,
    )


def check_arrived(bucket: WeightBucket) -> None:
    """Core's arrival check (:func:`drivetrain_engine_core.rollout.check_arrived`) on the server's side of the
    socket, before anything is applied: a mismatch there is the transport's, so it is raised as the error the
    client answers by sending that bucket again.

    Raises:
        CorruptedBucketError: a tensor's bytes differ from what was sent (named, with the version and bucket).
    """
    try:
        check_arrived_in_core(bucket)
    except HandoffError as e:
        raise CorruptedBucketError(str(e)) from e


def tensor_fields(tensor: torch.Tensor) -> tuple[list[int], str, bytes]:
    """A tensor as (shape, dtype name, row-major bytes)."""
    return list(tensor.shape), str(tensor.dtype), as_bytes(tensor.detach().cpu()).numpy().tobytes()


def tensor_from(fields: tuple[list[int], str, bytes]) -> torch.Tensor:
    """The tensor :func:`tensor_fields` described."""
    shape, dtype, data = fields
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype_of(dtype)).view(tuple(shape))


def sampling_fields(sampling: SamplingConfig) -> dict[str, Any]:
    """``sampling`` as plain values (:class:`SamplingConfig` ``(**fields)`` rebuilds it)."""
    return dataclasses.asdict(sampling)


def error_reply(error: BaseException) -> tuple[str, str, str]:
    """The reply that reports ``error`` to the trainer."""
    return ("error", type(error).__name__, str(error))


def raise_error(kind: str, message: str, *, server: str) -> None:
    """Raise what the server reported: the same drivetrain error type, else a :class:`RolloutServerError`."""
    known = ERRORS.get(kind)
    if known is not None:
        raise known(message)
    raise RolloutServerError(f"{server} failed with {kind}: {message}")


class RolloutServerError(DrivetrainError, RuntimeError):
    """The vLLM server process exited, stopped answering or failed unexpectedly; the message says which, and
    ends with the server's last log lines."""
