"""Packing a lazy stream of ``(name, full tensor)`` pairs into bounded :class:`WeightBucket` objects.

NOTE: memory is bounded by construction. Each tensor is copied into the current buffer as soon as it arrives
and the producer's tensor is released before the next one is requested, so at any moment the stream holds one
buffer (at most ``bucket_bytes``) plus the one tensor the backend just gathered. A bucket is handed out only
when the next tensor does not fit (so ``last`` is known) or the producer is exhausted; the consumer should
drop a bucket before asking for the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .bucket import LoraMode, TensorSpec, WeightBucket, aligned, as_bytes

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""512 MiB, verl's default bucket size for weight updates."""


class _Buffer:
    """The bucket being filled: a preallocated byte buffer and the specs written into it so far."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.bytes = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.specs: list[TensorSpec] = []
        self.used = 0

    def fits(self, size: int) -> bool:
        return aligned(self.used) + size <= self.bytes.numel()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        offset = aligned(self.used)
        flat = as_bytes(tensor)
        self.bytes[offset : offset + flat.numel()].copy_(flat)
        self.specs.append(TensorSpec(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype, offset=offset))
        self.used = offset + flat.numel()


def bucket_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    lora: LoraMode = "merged",
    adapter_config: Mapping[str, Any] | None = None,
) -> Iterator[WeightBucket]:
    """Pack ``tensors`` (consumed lazily, one at a time) into buckets of at most ``bucket_bytes`` bytes.

    Args:
        tensors: ``(name, full tensor)`` pairs, e.g. from a backend's export hook.
        version: the training step of the weights, written into every bucket.
        bucket_bytes: the most bytes one buffer holds; a tensor larger than that is a bucket of its own.
        dtype: cast every floating-point tensor to this dtype (``None`` keeps each tensor's dtype).
        lora: what the tensors are (``merged`` full weights or ``adapter`` tensors), recorded in each bucket.
        adapter_config: the PEFT adapter config, recorded in each bucket in adapter mode.

    Yields:
        Buckets numbered from 0; the final one has ``last=True`` (an empty model yields one empty bucket).

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}.")
    meta = {"version": version, "lora": lora, "adapter_config": adapter_config}
    current: _Buffer | None = None
    index = 0
    for name, tensor in tensors:
        tensor = _cast(tensor.detach(), dtype)
        size = tensor.numel() * tensor.element_size()
        if current is not None and not current.fits(size):
            yield _finish(current, index, last=False, **meta)
            current, index = None, index + 1
        if current is None:
            current = _Buffer(max(bucket_bytes, size), tensor.device)
        current.add(name, tensor)
        del tensor  # release the gathered tensor before the producer gathers the next one
    yield _finish(current or _Buffer(0, torch.device("cpu")), index, last=True, **meta)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


def _finish(buffer: _Buffer, index: int, *, last: bool, **meta: Any) -> WeightBucket:
    return WeightBucket(
        index=index, last=last, specs=tuple(buffer.specs), buffer=buffer.bytes[: buffer.used], **meta
    )
