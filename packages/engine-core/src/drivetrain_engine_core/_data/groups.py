"""Groups of sequences that must stay together, and per-sequence non-tensor fields (ARCHITECTURE §4).

Sequences that share a ``uid`` form one group: the chosen and rejected responses of a preference pair, or the
``n`` samples of one prompt. A pairwise or group-relative loss needs the whole group in one micro-batch (and so
on one data-parallel rank), so micro-batching and data-parallel sharding move groups, never single members.
A batch without ``uid`` has one group per sequence.

Per-sequence fields that are not tensors (``uid`` strings, ``data_source`` names) are ``NonTensorStack``
entries of the batch, one value per sequence (``batch["uid"] = ["p0", "p0", "p1", ...]``); they travel with
their sequences through micro-batches and shards and come back with the outputs. A ``NonTensorData`` entry
(one value for the whole batch) is a forward option instead (:mod:`.options`).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict
from torch import Tensor

from .batch import field_names

UID = "uid"
"""The per-sequence field whose equal values make a group (a ``NonTensorStack`` or a dense integer tensor)."""


def is_sequence_field(value: object) -> bool:
    """Whether ``value`` is a per-sequence non-tensor field (one Python value per sequence)."""
    return isinstance(value, NonTensorStack)


def sequence_fields(batch: TensorDict) -> dict[str, Any]:
    """The per-sequence non-tensor fields of ``batch`` by name (in the batch's sequence order)."""
    return {key: batch.get(key) for key in field_names(batch) if is_sequence_field(batch.get(key))}


def sequence_groups(batch: TensorDict) -> list[list[int]] | None:
    """Indices of the sequences of each ``uid``, groups in order of first appearance.

    Members of a group need not be adjacent, but usually are (a pair, the samples of one prompt).

    Returns:
        The groups, or ``None`` when every sequence is a group of its own (no ``uid``, or all distinct).
    """
    if UID not in field_names(batch):
        return None
    value = batch.get(UID)
    keys = value.tolist() if isinstance(value, (Tensor, NonTensorStack)) else list(value)
    members: dict[Any, list[int]] = {}
    for index, key in enumerate(keys):
        members.setdefault(_hashable(key), []).append(index)
    return None if len(members) == len(keys) else list(members.values())


def group_totals(per_sequence: Tensor, groups: list[list[int]]) -> Tensor:
    """``per_sequence`` values (tokens, workloads) summed over each group's members."""
    owner = torch.empty(len(per_sequence), dtype=torch.int64)
    for number, members in enumerate(groups):
        owner[members] = number
    totals = torch.zeros(len(groups), dtype=per_sequence.dtype)
    return totals.index_add(0, owner, per_sequence.cpu())


def expand_groups(parts: list[list[int]], groups: list[list[int]] | None) -> list[Tensor]:
    """Sequence indices (sorted int64) of each part, a part being a list of group numbers (or of sequences
    when ``groups`` is ``None``)."""
    if groups is None:
        return [torch.tensor(sorted(part), dtype=torch.int64) for part in parts]
    return [torch.tensor(sorted(i for g in part for i in groups[g]), dtype=torch.int64) for part in parts]


def describe_group(batch: TensorDict, members: list[int]) -> str:
    """``uid 'p3' (sequences [6, 7])``: how error messages name a group."""
    return f"uid {batch.get(UID).tolist()[members[0]]!r} (sequences {members})"


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
