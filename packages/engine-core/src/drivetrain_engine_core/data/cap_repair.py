"""Bringing a workload-balanced partition under a hard token cap with the smallest workload disturbance.

Karmarkar-Karp balances workload (quadratic in length), not tokens, so at the smallest feasible micro-batch
count a few groups often overshoot the token cap by a few hundred tokens. Rather than adding a micro-batch
(slower steps) this pass fixes each over-cap group by one move or swap with another group that leaves both
groups within the cap. Every step brings one over-cap group under the cap without pushing another over it, so
the pass ends after at most ``count`` steps. Among feasible steps it takes the one after which the busier of
the two groups involved has the least workload, so balance degrades as little as possible.
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
        workloads: cost per item (``(n,)``); each step picks the move whose busier group ends lightest.
        cap: the hard token cap per group.
    """
    state = _State(groups, lengths.to(torch.int64), workloads.to(torch.float64))
    for _ in range(len(groups) + 1):
        over = int(state.tokens.argmax())
        if int(state.tokens[over]) <= cap:
            return [sorted((state.group_of == g).nonzero().flatten().tolist()) for g in range(len(groups))]
        step = state.best_step(over, cap)
        if step is None:
            return None
        state.apply(over, *step)
    return None


class _State:
    """Group membership with per-group token, workload and size totals."""

    def __init__(self, groups: list[list[int]], lengths: Tensor, work: Tensor) -> None:
        self.lengths, self.work = lengths, work
        self.group_of = torch.empty(len(lengths), dtype=torch.int64)
        for g, members in enumerate(groups):
            self.group_of[members] = g
        k = len(groups)
        self.tokens = torch.zeros(k, dtype=torch.int64).index_add_(0, self.group_of, lengths)
        self.load = torch.zeros(k, dtype=torch.float64).index_add_(0, self.group_of, work)
        self.sizes = torch.bincount(self.group_of, minlength=k)

    def best_step(self, over: int, cap: int) -> tuple[int, int, int] | None:
        """Feasible ``(x, y, target)`` (``y = -1``: plain move of ``x``) whose busier group ends lightest."""
        xs = (self.group_of == over).nonzero().flatten()
        ys = (self.group_of != over).nonzero().flatten()
        lx, wx = self.lengths[xs].unsqueeze(1), self.work[xs].unsqueeze(1)
        ly, wy, gy = self.lengths[ys], self.work[ys], self.group_of[ys]
        # Swaps: x leaves the over-cap group, y comes in; both groups must end within the cap.
        swap_ok = (self.tokens[over] - lx + ly <= cap) & (self.tokens[gy] - ly + lx <= cap)
        swap_peak = torch.maximum(self.load[over] - wx + wy, self.load[gy] - wy + wx)
        swap_cost = torch.where(swap_ok, swap_peak, torch.inf)
        # Moves: x goes to another group; the over-cap group must keep at least one sequence.
        targets = torch.arange(len(self.tokens))
        move_ok = (self.tokens[over] - lx <= cap) & (self.tokens + lx <= cap) & (targets != over)
        move_ok &= self.sizes[over] > 1
        move_cost = torch.where(move_ok, torch.maximum(self.load[over] - wx, self.load + wx), torch.inf)
        best_swap = int(swap_cost.argmin()) if swap_cost.numel() else -1
        best_move = int(move_cost.argmin())
        swap_value = float(swap_cost.flatten()[best_swap]) if best_swap >= 0 else float("inf")
        move_value = float(move_cost.flatten()[best_move])
        if min(swap_value, move_value) == float("inf"):
            return None
        if swap_value <= move_value:
            x, y = divmod(best_swap, len(ys))
            return int(xs[x]), int(ys[y]), int(gy[y])
        x, target = divmod(best_move, len(self.tokens))
        return int(xs[x]), -1, target

    def apply(self, over: int, x: int, y: int, target: int) -> None:
        self._move(x, over, target)
        if y >= 0:
            self._move(y, target, over)

    def _move(self, item: int, source: int, target: int) -> None:
        self.group_of[item] = target
        for group, sign in ((source, -1), (target, 1)):
            self.tokens[group] += sign * self.lengths[item]
            self.load[group] += sign * self.work[item]
            self.sizes[group] += sign
