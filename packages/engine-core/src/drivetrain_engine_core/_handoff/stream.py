"""Packing a lazy stream of ``(name, full tensor)`` pairs into bounded :class:`WeightBucket` objects.

NOTE: memory is bounded by construction. Each tensor is copied into the current buffer as soon as it arrives
and the producer's tensor is released before the next one is requested, so at any moment the stream holds one
buffer (at most ``bucket_bytes``) plus the one tensor the backend just gathered. A bucket is handed out only
when the next tensor does not fit (so ``last`` is known) or the producer is exhausted; the consumer should
drop a bucket before asking for the next one.

A delta stream (``base`` given) packs only tensors whose digest differs from the base version's and lists the
others as ``unchanged`` in the bucket being filled; each tensor is hashed as it arrives, in the stream dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .bucket import LoraMode, TensorDigest, TensorSpec, WeightBucket, aligned, as_bytes
from .digest import digest_of

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""512 MiB, verl's default bucket size for weight updates."""


@dataclass(frozen=True)
class BaseVersion:
    """The version a delta stream applies to, and each of its tensors as it was sent (by name)."""

    version: int
    digests: Mapping[str, TensorDigest]


class _Buffer:
    """The bucket being filled: a preallocated byte buffer and the specs written into it so far."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.bytes = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.specs: list[TensorSpec] = []
        self.used = 0

    def fits(self, size: int) -> bool:
        return aligned(self.used) + size <= self.bytes.numel()

    def add(self, held: TensorDigest, flat: torch.Tensor) -> None:
        """Copy ``flat`` (the tensor's bytes, :func:`.bucket.as_bytes`) in at the next aligned offset."""
        offset = aligned(self.used)
        self.bytes[offset : offset + flat.numel()].copy_(flat)
        self.specs.append(TensorSpec(**held.__dict__, offset=offset))
        self.used = offset + flat.numel()


class _Pending:
    """What the next bucket accounts for: its buffer (made when a tensor is to be sent) and the unchanged
    tensors listed since the last bucket."""

    def __init__(self) -> None:
        self.buffer: _Buffer | None = None
        self.unchanged: list[TensorDigest] = []


def bucket_tensors(
    tensors: Iterable[tuple[str, torch.Tensor | TensorDigest]],
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    lora: LoraMode = "merged",
    adapter_config: Mapping[str, Any] | None = None,
    base: BaseVersion | None = None,
) -> Iterator[WeightBucket]:
    """Pack ``tensors`` (consumed lazily, one at a time) into buckets of at most ``bucket_bytes`` bytes.

    Args:
        tensors: ``(name, full tensor)`` pairs, e.g. from a backend's export hook; in a delta stream, a
            tensor known to equal its base may come as the base's :class:`TensorDigest` (listed unchanged).
        version: the training step of the weights, written into every bucket.
        bucket_bytes: the most bytes one buffer holds; a tensor larger than that is a bucket of its own.
        dtype: cast every floating-point tensor to this dtype (``None`` keeps each tensor's dtype).
        lora: what the tensors are (``merged`` full weights or ``adapter`` tensors), recorded in each bucket.
        adapter_config: the PEFT adapter config, recorded in each bucket in adapter mode.
        base: for a delta stream, the version the receiver serves and the digests it was sent with: a tensor
            equal to its base (name, shape, dtype and digest) is listed as unchanged instead of sent.

    Yields:
        Buckets numbered from 0; the final one has ``last=True`` (an empty model yields one empty bucket).

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}.")
    meta = {
        "version": version,
        "lora": lora,
        "adapter_config": adapter_config,
        "base_version": None if base is None else base.version,
    }
    pending = _Pending()
    index = 0
    for name, tensor in tensors:
        if isinstance(tensor, TensorDigest):  # known unchanged without its bytes (:mod:`.local_shards`)
            pending.unchanged.append(tensor)
            continue
        tensor = _cast(tensor.detach(), dtype)
        flat = as_bytes(tensor)  # hashed and copied from the same bytes (one contiguous copy at most)
        held = TensorDigest(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype, digest=digest_of(flat))
        del (
            tensor
        )  # release the gathered tensor before the producer gathers the next one (flat holds its bytes)
        if base is not None and held.same_bytes(base.digests.get(name)):
            pending.unchanged.append(held)
            continue
        if pending.buffer is not None and not pending.buffer.fits(flat.numel()):
            yield _finish(pending, index, last=False, **meta)
            pending, index = _Pending(), index + 1
        if pending.buffer is None:
            pending.buffer = _Buffer(max(bucket_bytes, flat.numel()), flat.device)
        pending.buffer.add(held, flat)
        del flat
    yield _finish(pending, index, last=True, **meta)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def _finish(pending: _Pending, index: int, *, last: bool, **meta: Any) -> WeightBucket:
    buffer = pending.buffer or _Buffer(0, torch.device("cpu"))
    return WeightBucket(
        index=index,
        last=last,
        specs=tuple(buffer.specs),
        buffer=buffer.bytes[: buffer.used],
        unchanged=tuple(pending.unchanged),
        **meta,
    )
