"""Bringing a workload-balanced partition under a hard token cap with the smallest workload disturbance.

Karmarkar-Karp balances workload (quadratic in length), not tokens, so at the smallest feasible micro-batch
count a few groups often overshoot the token cap by a few hundred tokens. Rather than adding a micro-batch
(slower steps) this pass moves or swaps sequences between groups: each step takes the fullest group, keeps
the other group within the cap and strictly lowers the fullest group's tokens, so the total overflow falls at
every step. Among steps that bring the fullest group within the cap it takes the one after which the busier of
the two groups has the least workload, so balance degrades as little as possible.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor


def repair_to_cap(
    groups: list[list[int]], lengths: Tensor, workloads: Tensor, cap: int
) -> list[list[int]] | None:
    """``groups`` with every group's token total within ``cap``, or ``None`` if that was not reached.

    Args:
        groups: a partition of ``range(n)`` into non-empty groups.
        lengths: tokens per item (``(n,)``).
        workloads: cost per item (``(n,)``); each step picks the move whose busier group ends lightest.
        cap: the hard token cap per group.
    """
    state = _State(groups, lengths.cpu().numpy().astype(np.int64), workloads.cpu().numpy().astype(np.float64))
    # Partial steps move one sequence out of an over-cap group and finishing steps end its overflow, so a
    # repair that can succeed needs at most one step per sequence plus one per group.
    for _ in range(len(lengths) + len(groups) + 1):
        over = int(state.tokens.argmax())
        if state.tokens[over] <= cap:
            return [sorted(np.flatnonzero(state.group_of == g).tolist()) for g in range(len(groups))]
        step = state.best_step(over, cap)
        if step is None:
            return None
        state.apply(over, *step)
    return None


class _State:
    """Group membership with per-group token, workload and size totals.

    NumPy rather than torch: a repair is a few dozen steps of ~15 operations on arrays of a few hundred
    elements, where torch's per-operation dispatch cost would dominate (numpy is a dependency of tensordict).
    """

    def __init__(self, groups: list[list[int]], lengths: np.ndarray, work: np.ndarray) -> None:
        k = len(groups)
        self.lengths, self.work = lengths, work
        self.group_of = np.empty(len(lengths), dtype=np.int64)
        for g, members in enumerate(groups):
            self.group_of[members] = g
        self.tokens = np.bincount(self.group_of, weights=lengths, minlength=k).astype(np.int64)
        self.load = np.bincount(self.group_of, weights=work, minlength=k)
        self.sizes = np.bincount(self.group_of, minlength=k)
        # Candidates for the sequence that comes back: every item, then one "nothing" per group (a plain move).
        self.cand_item = np.concatenate([np.arange(len(lengths)), np.full(k, -1)])
        self.cand_group = np.concatenate([self.group_of, np.arange(k)])
        self.cand_length = np.concatenate([lengths, np.zeros(k, dtype=np.int64)])
        self.cand_work = np.concatenate([work, np.zeros(k)])

    def best_step(self, over: int, cap: int) -> tuple[int, int, int] | None:
        """The next ``(x, y, target)``: ``x`` leaves ``over`` for ``target``, ``y`` comes back (``-1``: none).

        A step must keep ``target`` within the cap and shrink ``over``. Steps that bring ``over`` within the
        cap are preferred, the one whose busier group ends lightest first; if there is none, the step that
        shrinks ``over`` the most is taken and the next step continues on it.
        """
        xs = np.flatnonzero(self.group_of == over)
        lx, wx = self.lengths[xs, None], self.work[xs, None]
        group, length, work = self.cand_group, self.cand_length, self.cand_work
        new_over = self.tokens[over] - lx + length
        valid = (self.tokens[group] - length + lx <= cap) & (new_over < self.tokens[over]) & (group != over)
        if self.sizes[over] == 1:  # a group never empties: only swaps
            valid &= self.cand_item >= 0
        if not valid.any():
            return None
        fixes = valid & (new_over <= cap)
        if fixes.any():
            cost = np.where(
                fixes, np.maximum(self.load[over] - wx + work, self.load[group] - work + wx), np.inf
            )
        else:
            cost = np.where(valid, new_over, np.inf)
        x, c = divmod(int(cost.argmin()), len(group))
        return int(xs[x]), int(self.cand_item[c]), int(group[c])

    def apply(self, over: int, x: int, y: int, target: int) -> None:
        self._move(x, over, target)
        if y >= 0:
            self._move(y, target, over)

    def _move(self, item: int, source: int, target: int) -> None:
        self.group_of[item] = target
        self.cand_group[item] = target
        self.tokens[source] -= self.lengths[item]
        self.tokens[target] += self.lengths[item]
        self.load[source] -= self.work[item]
        self.load[target] += self.work[item]
        self.sizes[source] -= 1
        self.sizes[target] += 1
