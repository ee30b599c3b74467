"""One unit of the hand-off stream: a flat byte buffer holding whole tensors, and what each tensor is."""

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
class TensorSpec:
    """Where one tensor lives in a bucket's buffer.

    Attributes:
        name: Hugging Face name (``model.layers.0.mlp.up_proj.weight``), or the PEFT adapter name
            (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) in adapter mode.
        shape: the full (unsharded) shape.
        dtype: the element type.
        offset: first byte in the buffer (a multiple of :data:`ALIGNMENT`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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
    """

    version: int
    index: int
    last: bool
    lora: LoraMode
    specs: tuple[TensorSpec, ...]
    buffer: torch.Tensor
    adapter_config: Mapping[str, Any] | None = field(default=None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (the tensors plus alignment padding)."""
        return int(self.buffer.numel())

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
