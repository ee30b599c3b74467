"""Balanced partitioning of sequences by workload (Karmarkar-Karp largest differencing method).

Used to balance micro-batches inside a rank and sequences across data-parallel ranks. The differencing keeps
only bucket sums and the permutation of each merge; bucket members are resolved once at the end, top down,
so a merge costs O(k log k) whatever the number of items.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import add, itemgetter

import torch
from torch import Tensor

from .._errors import BatchError

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
    if k == 1:
        return [list(range(n))]
    weights = [float(w) for w in workloads]
    leaves = _leaves(weights, k, equal_size)
    merges = _differencing(leaves, weights, k)
    return _resolve(leaves, merges, k)


def _leaves(weights: list[float], k: int, equal_size: bool) -> list[list[int]]:
    """Initial states as the items of their top buckets (the buckets below are empty), ascending by workload.

    Unequal sizes: one state per item. Equal sizes: items sorted by workload in consecutive groups of ``k``,
    one per bucket.
    """
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:
        return [order[start : start + k] for start in range(0, len(order), k)]
    return [[i] for i in order]


def _differencing(leaves: list[list[int]], weights: list[float], k: int) -> list[tuple]:
    """Run the merges; return them as ``(node_a, node_b, order)`` records, node ids after the leaves.

    A state is ``(sums ascending, node id)``; merging pairs ``a``'s bucket ``i`` with ``b``'s bucket
    ``k - 1 - i`` and re-sorts, so new bucket ``j`` holds ``a[order[j]]`` and ``b[k - 1 - order[j]]``. Only
    sums and permutations are kept (members are resolved once at the end), and the sums and sorts run in C
    (``map``, ``sorted`` with a C key): a merge costs a few microseconds for k around 40.
    """
    heap = []
    for node, members in enumerate(leaves):
        sums = [0.0] * (k - len(members)) + [weights[i] for i in members]
        heap.append((sums[0] - sums[-1], node, sums))
    heapq.heapify(heap)
    merges: list[tuple] = []
    next_node = len(leaves)
    while len(heap) > 1:
        _, node_a, sums_a = heapq.heappop(heap)
        _, node_b, sums_b = heapq.heappop(heap)
        paired = list(map(add, sums_a, reversed(sums_b)))
        order = sorted(range(k), key=paired.__getitem__)
        sums = sorted(paired)
        merges.append((node_a, node_b, order))
        heapq.heappush(heap, (sums[0] - sums[-1], next_node, sums))
        next_node += 1
    return merges


def _resolve(leaves: list[list[int]], merges: list[tuple], k: int) -> list[list[int]]:
    """Walk the merges from the root down to give every bucket of every state its final partition."""
    # Every state is labelled before it is read: states are visited from the root (the last merge) down.
    labels: list[tuple[int, ...]] = [()] * (len(leaves) + len(merges))
    labels[-1] = tuple(range(k))
    for offset in range(len(merges) - 1, -1, -1):
        node_a, node_b, order = merges[offset]
        own = labels[len(leaves) + offset]
        inverse = sorted(range(k), key=order.__getitem__)
        # a's bucket order[j] and b's bucket k-1-order[j] both went into this state's bucket j.
        labels[node_a] = itemgetter(*inverse)(own)
        labels[node_b] = itemgetter(*reversed(inverse))(own)
    groups: list[list[int]] = [[] for _ in range(k)]
    for node, members in enumerate(leaves):
        for item, label in zip(members, labels[node][k - len(members) :], strict=True):
            groups[label].append(item)
    return [sorted(g) for g in groups]
