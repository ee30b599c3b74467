"""Bringing a workload-balanced partition under a hard token cap with the smallest workload disturbance.

Karmarkar-Karp balances workload (quadratic in length), not tokens, so at the smallest feasible micro-batch
count a few groups often overshoot the token cap by a few hundred tokens. Rather than adding a micro-batch
(slower steps) this pass fixes each over-cap group by one move or swap with another group, choosing, among the
moves that leave both groups within the cap, the one whose workload change is smallest. Every step brings one
over-cap group under the cap without pushing another over it, so the pass ends after at most ``count`` steps.
"""

from __future__ import annotations

import torch
from torch import Tensor


def repair_to_cap(
    groups: list[list[int]], lengths: Tensor, workloads: Tensor, cap: int
) -> list[list[int]] | None:
    """``groups`` with every group's token total within ``cap``, or ``None`` if some group cannot be fixed.

    Args:
        groups: a partition of ``range(n)`` into non-empty groups.
        lengths: tokens per item (int64, ``(n,)``).
        workloads: cost per item (``(n,)``), used to pick the least disturbing move.
        cap: the hard token cap per group.
    """
    lengths = lengths.to(torch.int64)
    group_of = torch.empty(len(lengths), dtype=torch.int64)
    for g, members in enumerate(groups):
        group_of[members] = g
    tokens = torch.zeros(len(groups), dtype=torch.int64).index_add_(0, group_of, lengths)
    sizes = torch.bincount(group_of, minlength=len(groups))
    for _ in range(len(groups) + 1):
        over = int(tokens.argmax())
        if int(tokens[over]) <= cap:
            return [sorted((group_of == g).nonzero().flatten().tolist()) for g in range(len(groups))]
        step = _best_step(over, group_of, tokens, sizes, lengths, workloads.to(torch.float64), cap)
        if step is None:
            return None
        _apply(step, over, group_of, tokens, sizes, lengths)
    return None


def _best_step(
    over: int, group_of: Tensor, tokens: Tensor, sizes: Tensor, lengths: Tensor, work: Tensor, cap: int
) -> tuple[int, int, int] | None:
    """The feasible ``(x, y, target)`` (``y = -1`` for a plain move of ``x`` into ``target``) of least cost."""
    xs = (group_of == over).nonzero().flatten()
    ys = (group_of != over).nonzero().flatten()
    lx, wx = lengths[xs].unsqueeze(1), work[xs].unsqueeze(1)
    # Swaps: x leaves the over-cap group, y comes in; both groups must end within the cap.
    swap_ok = (tokens[over] - lx + lengths[ys] <= cap) & (tokens[group_of[ys]] - lengths[ys] + lx <= cap)
    swap_cost = torch.where(swap_ok, (wx - work[ys]).abs(), torch.inf)
    # Moves: x goes to another group; the over-cap group must keep at least one sequence.
    targets = torch.arange(len(tokens))
    move_ok = (tokens[over] - lx <= cap) & (tokens + lx <= cap) & (targets != over) & (sizes[over] > 1)
    move_cost = torch.where(move_ok, wx.expand(-1, len(tokens)), torch.inf)
    best_swap = int(swap_cost.argmin()) if swap_cost.numel() else -1
    best_move = int(move_cost.argmin())
    swap_value = float(swap_cost.flatten()[best_swap]) if best_swap >= 0 else float("inf")
    move_value = float(move_cost.flatten()[best_move])
    if min(swap_value, move_value) == float("inf"):
        return None
    if swap_value <= move_value:
        x, y = divmod(best_swap, len(ys))
        return int(xs[x]), int(ys[y]), int(group_of[ys[y]])
    x, target = divmod(best_move, len(tokens))
    return int(xs[x]), -1, target


def _apply(
    step: tuple[int, int, int], over: int, group_of: Tensor, tokens: Tensor, sizes: Tensor, lengths: Tensor
) -> None:
    x, y, target = step
    group_of[x] = target
    tokens[over] -= lengths[x]
    tokens[target] += lengths[x]
    sizes[over] -= 1
    sizes[target] += 1
    if y >= 0:
        group_of[y] = over
        tokens[target] -= lengths[y]
        tokens[over] += lengths[y]
        sizes[target] -= 1
        sizes[over] += 1
