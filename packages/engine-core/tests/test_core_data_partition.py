"""Karmarkar-Karp partitions: permutations, equal sizes, better balance than round robin, clear errors."""

from __future__ import annotations

import pytest
import torch
from drivetrain_engine_core._data import estimate_workload, karmarkar_karp
from drivetrain_engine_core._data.cap_repair import repair_to_cap
from drivetrain_engine_core.backend import BatchError
from hypothesis import given, settings
from hypothesis import strategies as st


def _spread(groups, weights):
    sums = [sum(weights[i] for i in g) for g in groups]
    return max(sums) - min(sums)


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 5000), min_size=1, max_size=60),
    k=st.integers(1, 8),
    equal=st.booleans(),
)
def test_kk_is_a_permutation_with_nonempty_groups(weights, k, equal):
    n = len(weights) - len(weights) % k if equal else len(weights)
    weights = weights[:n]
    if n < k:
        with pytest.raises(BatchError, match=rf"{n} items cannot fill {k}"):
            karmarkar_karp(weights, k, equal_size=equal)
        return
    groups = karmarkar_karp(weights, k, equal_size=equal)
    assert len(groups) == k and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(n))
    if equal:
        assert {len(g) for g in groups} == {n // k}


def test_kk_beats_round_robin_on_skewed_lengths():
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.exp(torch.randn(512, generator=gen) + 6).clamp(16, 4096)).round()
    weights = estimate_workload(lengths).tolist()
    for k, equal in ((8, True), (32, False)):
        kk = karmarkar_karp(weights, k, equal_size=equal)
        round_robin = [list(range(r, len(weights), k)) for r in range(k)]
        mean = sum(weights) / k
        assert _spread(kk, weights) < 0.02 * mean < _spread(round_robin, weights)


def test_kk_exact_small_case():
    # LDM by hand: differences 8-7=1, 6-5=1, 4-1=3, 3-1=2 -> the halves differ by 2 (16 vs 14).
    groups = karmarkar_karp([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in g) for g in groups)
    assert sums == [14, 16]


def test_kk_errors():
    with pytest.raises(BatchError, match=r"divisible"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(BatchError, match=r"num_partitions must be >= 1"):
        karmarkar_karp([1, 2, 3], 0)


def test_workload_is_quadratic_aware():
    work = estimate_workload(torch.tensor([1024, 2048]))
    # Doubling the length more than doubles the cost because of attention.
    assert float(work[1] / work[0]) > 2.0
    assert work.tolist() == [1024 + 1024**2 / 2048, 2048 + 2048**2 / 2048]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=6, max_size=40), k=st.integers(2, 6))
def test_repair_to_cap_fixes_a_skewed_partition_when_there_is_room(lengths, k):
    # With every group at most half full on average and no sequence above half the cap, a repair must succeed
    # whatever the start; start from the worst: everything but one sequence per group in group 0.
    cap = max(2 * max(lengths), -(-2 * sum(lengths) // k))
    n = len(lengths)
    groups = [list(range(n - k + 1)), *[[i] for i in range(n - k + 1, n)]]
    lengths_t = torch.tensor(lengths)
    repaired = repair_to_cap(groups, lengths_t, estimate_workload(lengths_t), cap)
    assert repaired is not None
    assert len(repaired) == k and all(repaired)
    assert sorted(i for g in repaired for i in g) == list(range(n))
    assert max(sum(lengths[i] for i in g) for g in repaired) <= cap


def test_repair_prefers_the_swap_that_keeps_workload_balanced():
    lengths = torch.tensor([10, 9, 2, 3])
    # Group 0 has 19 tokens over a cap of 13. Swapping 9 with 3 gives 13/11 tokens, swapping 9 with 2 gives
    # 12/12: both fit, the second has the lighter busier group.
    repaired = repair_to_cap([[0, 1], [2, 3]], lengths, estimate_workload(lengths), 13)
    assert sorted(sorted(g) for g in repaired) == [[0, 2], [1, 3]]
