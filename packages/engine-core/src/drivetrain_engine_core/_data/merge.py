"""Merging per-micro-batch (or per-rank) outputs back into one batch in the original sequence order.

Each jagged output field is gathered as flat values in original sequence order (concatenated only, with no
reordering, when the order already is the original one) and built once on the target offsets: the original
batch's own offsets tensor when known, so restored outputs combine with its fields, else one new offsets
tensor shared by every field. One output already in order on those offsets is returned untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from .._errors import BatchError
from .batch import field_names, is_jagged
from .jagged import offsets_of
from .rows import cumulative, gather_sequences, seqlen_bounds


def is_identity(order: Tensor) -> bool:
    """Whether ``order`` is ``0, 1, ..., n - 1``."""
    return bool(torch.equal(order, torch.arange(len(order), device=order.device)))


@dataclass(frozen=True)
class _Target:
    """Where one device's jagged outputs go.

    Attributes:
        offsets: target offsets on this device.
        stacked_lengths: sequence lengths in output order, on this device, to check each field against.
        seqlens: min/max sequence lengths of the target.
    """

    offsets: Tensor
    stacked_lengths: Tensor
    seqlens: dict[str, Any]

    def to(self, device: torch.device) -> _Target:
        return _Target(
            offsets=self.offsets.to(device),
            stacked_lengths=self.stacked_lengths.to(device),
            seqlens=self.seqlens,
        )


def merge_outputs(outputs: Sequence[TensorDict], order: Tensor, offsets: Tensor | None) -> TensorDict:
    """Concatenate ``outputs`` (rows in ``order``: original positions) and put rows back in original order.

    Args:
        outputs: TensorDicts with the same fields whose rows, one after the other, are sequences ``order``.
        order: original position of each concatenated row (a permutation of ``0..n-1``).
        offsets: the original batch's ``input_ids`` offsets, or ``None`` to take the lengths from the outputs.

    Raises:
        BatchError: an output misses a field, or a per-token field has other sequence lengths than the batch.
    """
    inverse = None if is_identity(order) else torch.argsort(order)
    targets: dict[torch.device, _Target] = {}
    merged = {}
    for key in field_names(outputs[0]):
        parts = [_field(out, key, i) for i, out in enumerate(outputs)]
        if is_jagged(parts[0]):
            merged[key] = _merge_jagged(key, parts, order, inverse, offsets, targets)
        else:
            value = parts[0] if len(parts) == 1 else torch.cat(parts)
            merged[key] = value if inverse is None else value[inverse.to(value.device)]
    return TensorDict(merged, batch_size=[len(order)], device=outputs[0].device)


def _field(output: TensorDict, key: str, index: int) -> Tensor:
    names = field_names(output)
    if key not in names:
        raise BatchError(
            f"restore: output {index} has no field {key!r} (it has {sorted(names)}) but output 0 has; "
            "every micro-batch must return the same fields."
        )
    return output.get(key)


def _merge_jagged(
    key: str,
    parts: list[Tensor],
    order: Tensor,
    inverse: Tensor | None,
    offsets: Tensor | None,
    targets: dict[torch.device, _Target],
) -> Tensor:
    part_lengths = [offsets_of(part).diff() for part in parts]
    stacked = part_lengths[0] if len(parts) == 1 else torch.cat(part_lengths)
    device = stacked.device
    if device not in targets:
        targets[device] = _target(stacked, order, inverse, offsets, targets, device)
    target = targets[device]
    if not torch.equal(stacked, target.stacked_lengths):
        raise BatchError(
            f"restore: per-token output {key!r} has sequence lengths {stacked.tolist()} (micro-batch order), the "
            f"batch has {target.stacked_lengths.tolist()}; per-token outputs need one value per input token."
        )
    if inverse is None and len(parts) == 1 and offsets_of(parts[0]) is target.offsets:
        return parts[0]
    order_list = None if inverse is None else inverse.tolist()
    lists = [lens.tolist() for lens in part_lengths] if order_list is not None else []
    values = gather_sequences(parts, lists, order_list)
    return torch.nested.nested_tensor_from_jagged(values, offsets=target.offsets, **target.seqlens)


def _target(
    stacked: Tensor,
    order: Tensor,
    inverse: Tensor | None,
    offsets: Tensor | None,
    targets: dict[torch.device, _Target],
    device: torch.device,
) -> _Target:
    """The target on ``device``: a copy of the first one built, else built from ``offsets`` or ``stacked``."""
    if targets:
        return next(iter(targets.values())).to(device)
    if offsets is None:
        lengths = stacked if inverse is None else stacked[inverse.to(device)]
        return _Target(offsets=cumulative(lengths), stacked_lengths=stacked, seqlens=seqlen_bounds(lengths))
    lengths = offsets.diff()
    expected = lengths if inverse is None else lengths[order.to(lengths.device)]
    target = _Target(offsets=offsets, stacked_lengths=expected, seqlens=seqlen_bounds(lengths))
    return target if offsets.device == device else target.to(device)
