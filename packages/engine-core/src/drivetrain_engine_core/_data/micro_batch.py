"""Cutting a rank's batch into micro-batches, and putting per-sample outputs back in the original order.

Fixed batching takes consecutive chunks of ``micro_batch_size`` sequences. Dynamic batching treats
``max_tokens`` as a hard cap: it picks the smallest micro-batch count, from the token lower bound
``ceil(total / max_tokens)`` up, at which a workload-balanced (Karmarkar-Karp) partition fits the cap once
``cap_repair`` has moved or swapped sequences out of over-cap groups, takes the maximum of that count over the
data-parallel group (every rank must run the same number of forward/backward passes, or collectives inside
the model would pair up wrongly), and partitions at that count. Both modes all-reduce the count, so ranks
holding different numbers of sequences still agree. A rank that holds fewer sequences (groups) than the agreed
count runs each in its own micro-batch and makes up the difference with *filler* passes
(:attr:`MicroBatches.fillers`): the engine runs its first sequence again so that every collective inside the
model pairs up, and drops the filler's outputs, loss and metrics (held-out sets and reference passes rarely
split evenly over ranks; verl pads such data to a multiple of the ranks instead).

Sequences that share a ``uid`` (:mod:`.groups`) stay in one micro-batch: both modes then place whole groups
(a group's tokens, or its number of sequences, against the limit), and a group larger than the limit is one
error on every rank that names the group and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from .. import _distributed as distributed
from .._agreement import agreed_checks
from .._config import MicroBatchConfig
from .._distributed import ProcessGroup
from .._errors import BatchError
from .batch import INPUT_IDS, field_names, sequence_lengths
from .cap_repair import repair_to_cap
from .groups import describe_group, expand_groups, group_totals, sequence_fields, sequence_groups
from .jagged import offsets_of
from .merge import is_identity, merge_outputs
from .padded_budget import padded_costs, plan_padded
from .partition import estimate_workload, karmarkar_karp
from .rows import select_groups, slice_rows

EXTRA_COUNTS_TRIED = 4
"""How many counts above the token lower bound are tried for a balanced partition before bin packing."""


@dataclass(frozen=True)
class MicroBatchCountRule:
    """Micro-batch counts a backend's schedule accepts: at least ``minimum``, a multiple of ``multiple_of``.

    Megatron's interleaved pipeline schedule (virtual pipeline stages) runs only counts that are multiples
    of the pipeline size, and at least one such group; other schedules accept any count (the default).
    """

    minimum: int = 1
    multiple_of: int = 1

    def __post_init__(self) -> None:
        if self.minimum < 1 or self.multiple_of < 1:
            raise ValueError(
                f"MicroBatchCountRule needs minimum >= 1 and multiple_of >= 1, got {self.minimum}, "
                f"{self.multiple_of}."
            )

    def apply(self, count: int) -> int:
        """The smallest accepted count that is at least ``count``."""
        return math.ceil(max(count, self.minimum) / self.multiple_of) * self.multiple_of


@dataclass
class MicroBatches:
    """Micro-batches of one batch and where their sequences came from.

    Attributes:
        batches: the micro-batches, each a TensorDict in the batch format (views of the batch's token data
            when they are contiguous ranges of it, the batch itself when one micro-batch covers it).
        indices: for each micro-batch, the original positions (int64) of its sequences, in its order.
        offsets: ``input_ids`` offsets of the original batch; restored per-token outputs are rebuilt on this
            very tensor so they combine with the original batch's fields (``log_probs * loss_mask``).
        carried: the original batch's per-sequence non-tensor fields (``uid``, ``data_source``), returned
            with the restored outputs so callers can match results to their sequences.
        fillers: passes to run after ``batches`` whose results are dropped (see the module docstring);
            ``len(batches) + fillers`` is the count every rank agreed on.
    """

    batches: list[TensorDict]
    indices: list[Tensor]
    offsets: Tensor | None = None
    carried: dict[str, Any] = field(default_factory=dict)
    fillers: int = 0

    @property
    def count(self) -> int:
        """Passes this rank runs, fillers included (the same on every rank of the group)."""
        return len(self.batches) + self.fillers

    def filler(self) -> TensorDict:
        """What a filler pass runs: the batch's first sequence (so its fields have the batch's shapes)."""
        return slice_rows(self.batches[0], 0, 1)

    def restore(self, outputs: Sequence[TensorDict]) -> TensorDict:
        """Concatenate per-micro-batch outputs and reorder them into the original sequence order.

        Outputs that already are the whole batch in order (one micro-batch) are returned without copying.

        Args:
            outputs: one TensorDict per micro-batch with ``batch_size=[len(indices[i])]``; per-token fields
                are jagged with that micro-batch's sequence lengths, dense fields have one row per sequence.

        Raises:
            BatchError: the outputs do not match the micro-batches.
        """
        if len(outputs) != len(self.indices):
            raise BatchError(f"restore: got {len(outputs)} outputs for {len(self.indices)} micro-batches.")
        for i, (out, idx) in enumerate(zip(outputs, self.indices, strict=True)):
            if list(out.batch_size) != [len(idx)]:
                raise BatchError(
                    f"restore: output {i} has batch_size {list(out.batch_size)}, its micro-batch has "
                    f"{len(idx)} sequences; return one row per sequence."
                )
        order = self.indices[0] if len(self.indices) == 1 else torch.cat(self.indices)
        merged = merge_outputs(outputs, order, self.offsets)
        for key, value in self.carried.items():
            if key not in field_names(merged):
                merged.set(key, value)
        return merged


def split_micro_batches(
    batch: TensorDict,
    config: MicroBatchConfig,
    dp_group: ProcessGroup | None = None,
    rule: MicroBatchCountRule = MicroBatchCountRule(),
) -> MicroBatches:
    """Cut ``batch`` into micro-batches (a collective over ``dp_group``: the count is all-reduced).

    Sequences sharing a ``uid`` are kept in one micro-batch.

    Args:
        batch: a validated batch (options already stripped).
        config: fixed ``micro_batch_size`` or dynamic ``max_tokens``.
        dp_group: data-parallel group whose ranks must agree on the count; ``None`` = default group.
        rule: the counts the backend's schedule accepts.

    Returns:
        The micro-batches, their original indices, the batch's per-sequence non-tensor fields and the filler
        passes this rank adds to reach the agreed count.

    Raises:
        BatchError: on every rank, when some rank holds a sequence (or a group) over the limit, or no sequence.
    """
    if batch.batch_size[0] == 0:
        raise BatchError("micro-batching: the batch holds no sequence; give every rank at least one.")
    groups = sequence_groups(batch)
    if config.max_tokens is not None and config.budget == "padded":
        indices, count = _padded_indices(batch, groups, config.max_tokens, rule, dp_group)
    elif config.max_tokens is not None:
        indices, count = _dynamic_indices(batch, groups, config.max_tokens, rule, dp_group)
    else:
        assert config.micro_batch_size is not None  # MicroBatchConfig sets exactly one of the two limits
        indices, count = _fixed_indices(batch, groups, config.micro_batch_size, rule, dp_group)
    return MicroBatches(
        batches=cut_batch(batch, indices),
        indices=indices,
        offsets=offsets_of(batch[INPUT_IDS]),
        carried=sequence_fields(batch),
        fillers=count - len(indices),
    )


def _dynamic_indices(
    batch: TensorDict,
    groups: list[list[int]] | None,
    max_tokens: int,
    rule: MicroBatchCountRule,
    dp_group: ProcessGroup | None,
) -> tuple[list[Tensor], int]:
    """Micro-batches under the token cap, placing groups (their summed tokens and workloads) as units; and the
    agreed count."""
    lengths = sequence_lengths(batch)
    workloads = estimate_workload(lengths)
    if groups is not None:
        lengths, workloads = group_totals(lengths, groups), group_totals(workloads, groups)
    with agreed_checks(dp_group):
        _require_within_budget(lengths, max_tokens, _namer(batch, groups))
    local_count, parts = plan_micro_batches(lengths, max_tokens, workloads)
    count = agree_on_count(local_count, rule, dp_group)
    if count != local_count:
        parts = partition_micro_batches(lengths, max_tokens, min(count, len(lengths)), workloads)
    return expand_groups(parts, groups), count


def _padded_indices(
    batch: TensorDict,
    groups: list[list[int]] | None,
    max_tokens: int,
    rule: MicroBatchCountRule,
    dp_group: ProcessGroup | None,
) -> tuple[list[Tensor], int]:
    """Micro-batches whose rows x longest sequence stays within ``max_tokens`` (:mod:`.padded_budget`); and
    the agreed count."""
    lengths = sequence_lengths(batch).cpu()
    members = groups if groups is not None else [[i] for i in range(len(lengths))]
    rows = torch.tensor([len(m) for m in members])
    longest = torch.stack([lengths[m].max() for m in members])
    with agreed_checks(dp_group):
        _require_within_budget(padded_costs(rows, longest), max_tokens, _namer(batch, groups))
    parts = plan_padded(rows, longest, max_tokens)
    count = agree_on_count(len(parts), rule, dp_group)
    return expand_groups(_split_to_count(parts, min(count, len(members))), groups), count


def _fixed_indices(
    batch: TensorDict,
    groups: list[list[int]] | None,
    micro_batch_size: int,
    rule: MicroBatchCountRule,
    dp_group: ProcessGroup | None,
) -> tuple[list[Tensor], int]:
    """Consecutive micro-batches of ``micro_batch_size`` sequences; with groups, of whole groups up to it; and
    the agreed count."""
    n = batch.batch_size[0]
    if groups is None:
        count = agree_on_count(math.ceil(n / micro_batch_size), rule, dp_group)
        return fixed_indices(n, micro_batch_size, min(count, n)), count
    sizes = torch.tensor([len(g) for g in groups])
    with agreed_checks(dp_group):
        _require_within_budget(sizes, micro_batch_size, _namer(batch, groups), option="micro_batch_size")
    parts = _consecutive_parts(sizes.tolist(), micro_batch_size)
    count = agree_on_count(len(parts), rule, dp_group)
    return expand_groups(_split_to_count(parts, min(count, len(groups))), groups), count


def _consecutive_parts(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive units, a new part whenever the next unit would take the part over ``cap``."""
    parts: list[list[int]] = [[]]
    room = cap
    for unit, size in enumerate(sizes):
        if size > room:
            parts.append([])
            room = cap
        parts[-1].append(unit)
        room -= size
    return parts


def _split_to_count(parts: list[list[int]], count: int) -> list[list[int]]:
    """``parts`` split (the part with most units in halves, in place) until there are ``count``."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        widest = max(range(len(parts)), key=lambda i: len(parts[i]))
        part = parts[widest]
        parts[widest : widest + 1] = [part[: len(part) // 2], part[len(part) // 2 :]]
    return parts


def _namer(batch: TensorDict, groups: list[list[int]] | None) -> Callable[[int], str]:
    """How an error names unit ``i``: a sequence, or a group by its ``uid``."""
    if groups is None:
        return lambda i: f"sequence {i}"
    return lambda i: f"the group of {describe_group(batch, groups[i])}"


def agree_on_count(local_count: int, rule: MicroBatchCountRule, dp_group: ProcessGroup | None) -> int:
    """The count every rank of ``dp_group`` runs: the maximum of the ranks' own counts, under ``rule``
    (one all-reduce). A rank with fewer sequences than that runs filler passes (:class:`MicroBatches`)."""
    return rule.apply(int(distributed.all_reduce_max(local_count, dp_group)))


def cut_batch(batch: TensorDict, indices: Sequence[Tensor]) -> list[TensorDict]:
    """The micro-batches ``indices`` of ``batch``: the batch itself if one covers it in order, views for
    contiguous ranges, copies otherwise (every micro-batch's jagged fields share one offsets tensor)."""
    if len(indices) == 1 and is_identity(indices[0]):
        return [batch]
    return select_groups(batch, indices)


def fixed_indices(n: int, micro_batch_size: int, count: int) -> list[Tensor]:
    """Consecutive chunks: ``micro_batch_size`` each (last one smaller) if that gives ``count`` chunks,
    else ``count`` near-equal chunks (another rank needed more micro-batches)."""
    if math.ceil(n / micro_batch_size) == count:
        return list(torch.arange(n).split(micro_batch_size))
    return list(torch.arange(n).tensor_split(count))


def micro_batch_count(lengths: Tensor, max_tokens: int) -> int:
    """The smallest count this rank can use under the hard token cap (before the max over ranks).

    This is the value a rank contributes to the all-reduce; exposed so tests and callers can reason about the
    count without a process group.
    """
    return plan_micro_batches(lengths, max_tokens)[0]


def plan_micro_batches(
    lengths: Tensor, max_tokens: int, workloads: Tensor | None = None
) -> tuple[int, list[list[int]]]:
    """This rank's count (see :func:`micro_batch_count`) and its groups at that count.

    The count is the smallest from the token lower bound ``ceil(total / max_tokens)`` up (at most
    ``EXTRA_COUNTS_TRIED`` above it) at which a balanced partition fits the cap, else first-fit decreasing's
    count. The groups are reused when the count agreed over ranks equals this rank's own. ``workloads``
    (default :func:`estimate_workload` of ``lengths``) is what the partition balances.

    Raises:
        BatchError: a sequence is longer than ``max_tokens``.
    """
    _require_within_budget(lengths, max_tokens)
    lower = max(1, math.ceil(int(lengths.sum()) / max_tokens))
    for count in range(lower, min(len(lengths), lower + EXTRA_COUNTS_TRIED) + 1):
        groups = _balanced(lengths, max_tokens, count, workloads)
        if groups is not None:
            return count, groups
    count = _first_fit_decreasing_count(lengths.tolist(), max_tokens)
    return count, _packed(lengths, max_tokens, count)


def partition_micro_batches(
    lengths: Tensor, max_tokens: int, count: int, workloads: Tensor | None = None
) -> list[list[int]]:
    """Exactly ``count`` non-empty groups of sequence indices, each within ``max_tokens`` tokens.

    Workload-balanced by Karmarkar-Karp when that fits the cap, else by capped greedy bin packing.

    Raises:
        BatchError: fewer sequences than ``count``, a sequence longer than the cap, or ``count`` too small.
    """
    _require_within_budget(lengths, max_tokens)
    if len(lengths) < count:
        raise BatchError(
            f"micro-batching: {len(lengths)} sequences cannot fill {count} micro-batches (none may be empty)."
        )
    groups = _balanced(lengths, max_tokens, count, workloads)
    return groups if groups is not None else _packed(lengths, max_tokens, count)


def _balanced(
    lengths: Tensor, max_tokens: int, count: int, workloads: Tensor | None = None
) -> list[list[int]] | None:
    """Karmarkar-Karp groups on workload, moved under the token cap if needed; ``None`` if that fails."""
    workloads = estimate_workload(lengths) if workloads is None else workloads
    groups = karmarkar_karp(workloads.tolist(), count)
    sizes = lengths.tolist()
    if all(sum(sizes[i] for i in g) <= max_tokens for g in groups):
        return groups
    return repair_to_cap(groups, lengths, workloads, max_tokens)


def _first_fit_decreasing_count(sizes: list[int], cap: int) -> int:
    free: list[int] = []
    for size in sorted(sizes, reverse=True):
        slot = next((b for b, room in enumerate(free) if room >= size), None)
        if slot is None:
            free.append(cap - size)
        else:
            free[slot] -= size
    return len(free)


def _packed(lengths: Tensor, max_tokens: int, count: int) -> list[list[int]]:
    """First-fit decreasing into ``count`` bins, then empty bins take one sequence from the fullest bins."""
    sizes = lengths.tolist()
    bins: list[list[int]] = [[] for _ in range(count)]
    free = [max_tokens] * count
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        slot = next((b for b in range(count) if free[b] >= sizes[i]), None)
        if slot is None:
            raise BatchError(
                f"micro-batching: {len(sizes)} sequences ({sum(sizes)} tokens) do not fit {count} micro-batches "
                f"of {max_tokens} tokens; use the count from micro_batch_count or raise max_tokens."
            )
        bins[slot].append(i)
        free[slot] -= sizes[i]
    for empty in [b for b in bins if not b]:
        donor = max(bins, key=len)
        empty.append(donor.pop())
    return [sorted(b) for b in bins]


def _require_within_budget(
    sizes: Tensor,
    limit: int,
    name: Callable[[int], str] = lambda i: f"sequence {i}",
    *,
    option: str = "max_tokens",
) -> None:
    """Raise naming the first unit (sequence or group) whose size exceeds the micro-batch ``limit``.

    ``option`` is ``max_tokens`` (sizes are tokens) or ``micro_batch_size`` (sizes are sequences of a group).
    """
    over = (sizes > limit).nonzero()
    if not len(over):
        return
    i = int(over[0])
    what, fix = ("tokens", " or truncate the sequences") if option == "max_tokens" else ("sequences", "")
    together = " (sequences sharing a uid stay in one micro-batch)" if name(i).startswith("the group") else ""
    raise BatchError(
        f"micro-batching: {name(i)} has {int(sizes[i])} {what}, more than the micro-batch limit "
        f"{option}={limit}{together}; raise micro_batch.{option} to at least {int(sizes.max())}{fix}."
    )
