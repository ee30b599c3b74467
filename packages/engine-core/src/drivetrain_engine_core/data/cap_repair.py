"""Bringing a workload-balanced partition under a hard token cap with the smallest workload disturbance.

Karmarkar-Karp balances workload (quadratic in length), not tokens, so at the smallest feasible micro-batch
count a few groups often overshoot the token cap by a few hundred tokens. Rather than adding a micro-batch
(slower steps) this pass moves or swaps sequences between groups: each step takes the fullest group, keeps
the other group within the cap and strictly lowers the fullest group's tokens, so the total overflow falls at
every step. Among steps that bring the fullest group within the cap it takes the one after which the busier of
the two groups has the least workload, so balance degrades as little as possible.
"""

from __future__ import annotations

import torch
from torch import Tensor


def repair_to_cap(
    groups: list[list[int]], lengths: Tensor, workloads: Tensor, cap: int
) -> list[list[int]] | None:
    """``groups`` with every group's token total within ``cap``, or ``None`` if that was not reached.

    Args:
        groups: a partition of ``range(n)`` into non-empty groups.
        lengths: tokens per item (int64, ``(n,)``).
        workloads: cost per item (``(n,)``); each step picks the move whose busier group ends lightest.
        cap: the hard token cap per group.
    """
    state = _State(groups, lengths.to(torch.int64), workloads.to(torch.float64))
    # Partial steps move one sequence out of an over-cap group and finishing steps end its overflow, so a
    # repair that can succeed needs at most one step per sequence plus one per group.
    for _ in range(len(lengths) + len(groups) + 1):
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
        """The next ``(x, y, target)``: ``x`` leaves ``over`` for ``target``, ``y`` comes back (``-1``: none).

        Candidates for ``y`` are every item of another group plus one "nothing" per group (a plain move).
        A step must keep ``target`` within the cap and shrink ``over``. Steps that bring ``over`` within the
        cap are preferred, the one whose busier group ends lightest first; if there is none, the step that
        shrinks ``over`` the most is taken and the next step continues on it.
        """
        k = len(self.tokens)
        xs = (self.group_of == over).nonzero().flatten()
        ys = (self.group_of != over).nonzero().flatten()
        lx, wx = self.lengths[xs].unsqueeze(1), self.work[xs].unsqueeze(1)
        none = torch.full((k,), -1, dtype=torch.int64)
        item = torch.cat([ys, none])
        group = torch.cat([self.group_of[ys], torch.arange(k)])
        length = torch.cat([self.lengths[ys], torch.zeros(k, dtype=torch.int64)])
        work = torch.cat([self.work[ys], torch.zeros(k, dtype=torch.float64)])
        new_over = self.tokens[over] - lx + length
        valid = (self.tokens[group] - length + lx <= cap) & (new_over < self.tokens[over]) & (group != over)
        valid &= (item >= 0) | (self.sizes[over] > 1)  # a group never empties
        if not bool(valid.any()):
            return None
        fixes = valid & (new_over <= cap)
        if bool(fixes.any()):
            peak = torch.maximum(self.load[over] - wx + work, self.load[group] - work + wx)
            cost = torch.where(fixes, peak, torch.inf)
        else:
            cost = torch.where(valid, new_over.to(torch.float64), torch.inf)
        x, c = divmod(int(cost.argmin()), len(item))
        return int(xs[x]), int(item[c]), int(group[c])

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
