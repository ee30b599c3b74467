"""Balanced partitioning of sequences by workload (Karmarkar-Karp largest differencing method).

Used to balance micro-batches inside a rank and sequences across data-parallel ranks. The implementation keeps
per-state bucket members as lazy merge trees and flattens them once at the end, so a merge costs O(k log k)
whatever the number of items; 4096 sequences partition in a few milliseconds.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
from collections.abc import Iterator, Sequence
from operator import add

import torch
from torch import Tensor

from ..errors import BatchError

ATTENTION_COST_PER_TOKEN_PAIR = 1.0 / 2048.0
"""Weight of the quadratic attention term relative to the linear (MLP, projections) term.

A transformer layer costs about ``24 h L`` FLOPs per token in its dense parts and ``4 L^2 h`` in attention, so
attention's share relative to the linear part is ``L / (6 h)``. With a typical hidden size ``h`` around 4096
and causal masking (half the pairs), ``L^2 / 2048`` puts the two on a common scale; verl uses a similar
length-squared-plus-linear cost. Only relative values matter for balancing.
"""


def estimate_workload(lengths: Tensor) -> Tensor:
    """Relative compute cost of each sequence: ``L + L^2 / 2048`` (float64, same shape as ``lengths``).

    Linear work (MLPs, projections, logits) grows with ``L``; attention grows with ``L^2``. Balancing on this
    estimate instead of token counts keeps long-sequence micro-batches from becoming the stragglers.
    """
    lengths = lengths.to(torch.float64)
    return lengths + lengths * lengths * ATTENTION_COST_PER_TOKEN_PAIR


def karmarkar_karp(
    workloads: Sequence[float], num_partitions: int, *, equal_size: bool = False
) -> list[list[int]]:
    """Split item indices into ``num_partitions`` groups with near-equal total workload.

    Largest differencing method: every item starts as a k-bucket state; the two states with the largest spread
    (max - min bucket sum) are merged repeatedly, pairing the heaviest buckets of one with the lightest of the
    other, until one state is left.

    Args:
        workloads: non-negative cost per item.
        num_partitions: number of groups ``k``.
        equal_size: every group gets ``len(workloads) / k`` items (requires divisibility); items then start
            in sorted groups of ``k``, one per bucket, so bucket counts stay equal through every merge.

    Returns:
        ``k`` lists of item indices, each sorted ascending; together a permutation of ``range(n)``. Groups are
        ordered by increasing total workload. Deterministic for the same input.

    Raises:
        BatchError: ``num_partitions`` < 1, more partitions than items, or unequal sizes requested for a
            count not divisible by ``num_partitions``.
    """
    k, n = num_partitions, len(workloads)
    if k < 1:
        raise BatchError(f"karmarkar_karp: num_partitions must be >= 1, got {k}.")
    if n < k:
        raise BatchError(f"karmarkar_karp: {n} items cannot fill {k} non-empty partitions; use at most {n}.")
    if equal_size and n % k:
        raise BatchError(
            f"karmarkar_karp: equal_size needs the item count ({n}) divisible by num_partitions ({k})."
        )
    with _gc_paused():
        heap = _initial_states([float(w) for w in workloads], k, equal_size)
        counter = len(heap)
        while len(heap) > 1:
            _, _, sums_a, members_a = heapq.heappop(heap)
            _, _, sums_b, members_b = heapq.heappop(heap)
            sums, members = _merge(sums_a, members_a, sums_b, members_b)
            heapq.heappush(heap, (sums[0] - sums[-1], counter, sums, members))
            counter += 1
        return [sorted(_flatten(tree)) for tree in heap[0][3]]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while merge trees are built.

    The algorithm allocates tens of thousands of small tuples (no cycles); left on, the collector's full
    passes over the whole interpreter heap (torch's objects included) cost more than the partitioning itself.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _initial_states(weights: list[float], k: int, equal_size: bool) -> list[tuple]:
    """Heap entries ``(-spread, tie, sums ascending, members)``; ties broken by creation order."""
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    states = []
    if equal_size:
        for start in range(0, len(order), k):
            group = order[start : start + k]
            states.append(([weights[i] for i in group], list(group)))
    else:
        for i in order:
            states.append(([0.0] * (k - 1) + [weights[i]], [None] * (k - 1) + [i]))
    heap = [(sums[0] - sums[-1], tie, sums, members) for tie, (sums, members) in enumerate(states)]
    heapq.heapify(heap)
    return heap


def _merge(sums_a: list[float], members_a: list, sums_b: list[float], members_b: list) -> tuple[list, list]:
    """Pair ``a``'s buckets ascending with ``b``'s descending; return the new state sorted ascending.

    Members are joined as ``(a_tree, b_tree)`` pairs and flattened once at the end; the sums and the sort run
    in C (``map``, ``sorted`` with a C key), which keeps a merge at a few microseconds for k around 40.
    """
    sums = list(map(add, sums_a, reversed(sums_b)))
    order = sorted(range(len(sums)), key=sums.__getitem__)
    members_b = members_b[::-1]
    return [sums[i] for i in order], [(members_a[i], members_b[i]) for i in order]


def _flatten(tree: object) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return out


def partition_workload(groups: Sequence[Sequence[int]], workloads: Tensor) -> Tensor:
    """Total workload of each group (float64, shape ``(len(groups),)``)."""
    return torch.stack([workloads[list(g)].sum() if g else workloads.new_zeros(()) for g in groups])
