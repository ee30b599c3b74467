"""One unit of the hand-off stream: a flat byte buffer holding whole tensors, what each tensor is, and the
digest of its bytes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

LoraMode = Literal["merged", "adapter"]
LORA_MODES: tuple[str, ...] = ("merged", "adapter")
"""``merged``: full weights with the adapters folded in; ``adapter``: only the PEFT adapter tensors."""

ALIGNMENT = 8
"""Byte alignment of each tensor in a buffer, so that every dtype can be viewed in place."""


@dataclass(frozen=True)
class TensorDigest:
    """One tensor of a version as the stream holds it: name, full shape, element type and bytes' digest.

    Attributes:
        name: Hugging Face name (``model.layers.0.mlp.up_proj.weight``), or the PEFT adapter name
            (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) in adapter mode.
        shape: the full (unsharded) shape.
        dtype: the element type in the stream (after the stream's cast).
        digest: :func:`.digest.digest_of` the tensor's bytes in ``dtype``, row-major.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    digest: str

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def same_bytes(self, other: TensorDigest | None) -> bool:
        """Whether ``other`` is the same tensor with the same bytes (wherever either lives in a buffer)."""
        return other is not None and (self.name, self.shape, self.dtype, self.digest) == (
            other.name,
            other.shape,
            other.dtype,
            other.digest,
        )


@dataclass(frozen=True)
class TensorSpec(TensorDigest):
    """A tensor sent in a bucket, and where it lives in the bucket's buffer.

    Attributes:
        offset: first byte in the buffer (a multiple of :data:`ALIGNMENT`).
    """

    offset: int


@dataclass(kw_only=True, frozen=True)
class WeightBucket:
    """Whole tensors packed into one flat ``uint8`` buffer, with their names, shapes and dtypes.

    Attributes:
        version: the training step the weights come from; every bucket of one hand-off carries the same one.
        index: position in the stream, from 0.
        last: whether this is the final bucket of the version (the receiver has everything after it).
        lora: ``merged`` (full weights) or ``adapter`` (PEFT adapter tensors only).
        specs: the tensors in the buffer, in stream order.
        buffer: the flat bytes (on the engine's device), ``buffer.numel()`` bytes long.
        adapter_config: in adapter mode, the PEFT ``adapter_config.json`` content; else ``None``.
        base_version: ``None`` for a full stream; for a delta stream, the version it applies to: only tensors
            whose bytes differ from that version's are sent, the others are listed in ``unchanged``.
        unchanged: tensors of the version not sent (unchanged since ``base_version``), in stream order.
    """

    version: int
    index: int
    last: bool
    lora: LoraMode
    specs: tuple[TensorSpec, ...]
    buffer: torch.Tensor
    adapter_config: Mapping[str, Any] | None = field(default=None)
    base_version: int | None = None
    unchanged: tuple[TensorDigest, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (the tensors plus alignment padding)."""
        return int(self.buffer.numel())

    @property
    def digests(self) -> tuple[TensorDigest, ...]:
        """Every tensor of the version this bucket accounts for: those sent, then those unchanged."""
        return (*self.specs, *self.unchanged)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into the buffer (no copy); copy them if the buffer is to be reused."""
        for spec in self.specs:
            raw = self.buffer[spec.offset : spec.offset + spec.nbytes]
            yield spec.name, raw.view(spec.dtype).view(spec.shape)


def aligned(size: int) -> int:
    """``size`` rounded up to :data:`ALIGNMENT`."""
    return -(-size // ALIGNMENT) * ALIGNMENT


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat ``uint8`` view (a copy only when it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
